"""`load_gsm8k_tfds` against a TFDS GSM8K folder prepared here, without TensorFlow.

The folder is written by TFDS's own gsm8k builder (`file_format='array_record'`)
in a temporary directory, fed the published test rows from the shared
benchmarks copy instead of its download; nothing is copied into the repo and
the network is blocked while building and while loading.
"""

import json
import os
import socket
import sys
from pathlib import Path

import pytest

from erpo_jax.data import benchmarks as bm
from benchmark_files import benchmarks_dir, require


ROOT = benchmarks_dir()
GSM8K_JSONL = ROOT / bm.BENCHMARKS["gsm8k"].path


@pytest.fixture(scope="module")
def gsm8k_jsonl():
    return require(GSM8K_JSONL)


# A test that reads the published file: fails in CI when it is missing, else skips.
needs_data = pytest.mark.usefixtures("gsm8k_jsonl")

import tensorflow_datasets as tfds  # noqa: E402  (a dependency of erpo-jax)
import tensorflow_datasets.text  # noqa: E402,F401  (registers gsm8k)
from tensorflow_datasets.text.gsm8k import gsm8k as tfds_gsm8k  # noqa: E402


ROWS = [
    {"question": "One plus one?", "answer": "1 + 1 = <<1+1=2>>2\n#### 2"},
    {"question": "Broken row?", "answer": "no final answer marker here"},
    {"question": "Big number?", "answer": "It is 1,234.\n#### 1,234"},
    {"question": "Ten minus three?", "answer": "10 - 3 = 7\n#### 7"},
]



class _NoNetwork(RuntimeError):
    pass


def _block_network(mp: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise _NoNetwork(f"network access attempted: {args!r}")

    mp.setattr(socket.socket, "connect", refuse)
    mp.setattr(socket, "create_connection", refuse)
    mp.setattr(socket, "getaddrinfo", refuse)


@pytest.fixture()
def no_network(monkeypatch):
    _block_network(monkeypatch)


class _LocalGsm8k(tfds_gsm8k.Gsm8k, skip_registration=True):
    """TFDS's gsm8k builder (same name, version, features and example keys),
    reading the test split from a local JSONL instead of downloading."""

    name = "gsm8k"

    def _split_generators(self, dl_manager):
        return {"test": self._generate_examples(GSM8K_JSONL)}

    def _generate_examples(self, path):
        # TFDS's own reader; the shared copy adds an `idx` column the builder
        # does not declare, so keep only the builder's features.
        for key, ex in super()._generate_examples(path):
            yield key, {k: ex[k] for k in tfds_gsm8k._FEATURES}


class _RowsGsm8k(tfds_gsm8k.Gsm8k, skip_registration=True):
    """The gsm8k builder fed hand-written rows, keyed by row number as TFDS's is."""

    name = "gsm8k"

    def _split_generators(self, dl_manager):
        return {"test": self._generate_examples(None)}

    def _generate_examples(self, path):
        for i, row in enumerate(ROWS):
            yield i, {k: row.get(k, "") for k in tfds_gsm8k._FEATURES}


def _prepare(builder_cls, data_dir: Path) -> Path:
    builder = builder_cls(data_dir=os.fspath(data_dir), file_format="array_record")
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(try_download_gcs=False)
    )
    return data_dir


@pytest.fixture(scope="module")
def prepared(gsm8k_jsonl, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        _block_network(mp)
        return _prepare(_LocalGsm8k, tmp_path_factory.mktemp("tfds"))


@needs_data
def test_prepared_folder_is_genuine_array_record(prepared):
    version_dir = prepared / "gsm8k" / str(tfds_gsm8k.Gsm8k.VERSION)
    info = json.loads((version_dir / "dataset_info.json").read_text())
    assert info["name"] == "gsm8k" and info["fileFormat"] == "array_record"
    assert [s["name"] for s in info["splits"]] == ["test"]
    assert sum(int(n) for n in info["splits"][0]["shardLengths"]) == 1319
    assert list(version_dir.glob("gsm8k-test.array_record-*-of-*"))
    assert "tensorflow" not in sys.modules  # built and read without TensorFlow


@needs_data
def test_present_branch_equals_jsonl_loader(prepared, no_network):
    got = bm.load_gsm8k_tfds(prepared)
    want = bm.load_benchmark("gsm8k", ROOT)
    assert got.skipped == 0 and want.skipped == 0
    assert len(got.problems) == len(want.problems) == 1319
    # Same ids, questions, golds, in the same (published) order.
    assert got.problems == want.problems
    assert got.problems[0].answer == "18" and got.problems[0].question.startswith("Janet")
    assert got.problems[2].answer == "70000"


@needs_data
def test_tfds_stores_records_shuffled_so_order_must_be_undone(prepared):
    # Guards the unshuffle in load_gsm8k_tfds: the raw record order differs
    # from the published line order, yet the loader gives line order back.
    source = tfds.data_source("gsm8k", split="test", data_dir=os.fspath(prepared), download=False)
    raw = [bytes(source[i]["question"]).decode() for i in range(len(source))]
    lines = [p.question for p in bm.load_benchmark("gsm8k", ROOT).problems]
    assert raw != lines and sorted(raw) == sorted(lines)
    assert len(set(lines)) == len(lines)
    assert bm._tfds_record_lines(len(source), "test", False) == [lines.index(q) for q in raw]


@pytest.fixture()
def small(tmp_path):
    mp = pytest.MonkeyPatch()
    _block_network(mp)
    try:
        return _prepare(_RowsGsm8k, tmp_path / "tfds")
    finally:
        mp.undo()


def test_bad_row_raises_or_is_skipped_and_ids_are_lines(small, no_network):
    with pytest.raises(bm.BadRowError, match=r"line 1\b"):
        bm.load_gsm8k_tfds(small)
    problems, skipped = bm.load_gsm8k_tfds(small, skip_bad_rows=True)
    assert skipped == 1
    assert [(p.id, p.question, p.answer) for p in problems] == [
        ("gsm8k/0", "One plus one?", "2"),
        ("gsm8k/2", "Big number?", "1234"),
        ("gsm8k/3", "Ten minus three?", "7"),
    ]


def test_split_errors(small, no_network):
    with pytest.raises(ValueError, match="plain split name"):
        bm.load_gsm8k_tfds(small, "test[:2]")
    with pytest.raises(ValueError, match="train"):
        bm.load_gsm8k_tfds(small, "train")


def test_tfrecord_prepared_folder_says_to_rebuild_as_array_record(small, no_network):
    info_path = small / "gsm8k" / str(tfds_gsm8k.Gsm8k.VERSION) / "dataset_info.json"
    info = json.loads(info_path.read_text())
    info["fileFormat"] = "tfrecord"
    info_path.write_text(json.dumps(info))
    with pytest.raises(ValueError, match="--file_format array_record"):
        bm.load_gsm8k_tfds(small)


def test_other_version_only_is_reported(small, no_network):
    version_dir = small / "gsm8k" / str(tfds_gsm8k.Gsm8k.VERSION)
    version_dir.rename(version_dir.with_name("0.0.1"))
    with pytest.raises(FileNotFoundError, match="0.0.1"):
        bm.load_gsm8k_tfds(small)
