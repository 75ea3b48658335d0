"""What a config change on resume (`train.allow_config_change`) does to the
state a checkpoint holds: each change either resumes by a stated rule or is
refused, before anything is written to the run directory.

The rules (the run header prints the ones that apply):
- the adaptive Policy-KL controller (`loss.kl_target`) added: it starts from
  `loss.beta_policy`, as a fresh run would;
- removed: the checkpoint's coefficient is dropped, Policy-KL is fixed at
  `loss.beta_policy`;
- `loss.beta_policy` changed on a run that stays adaptive: the controller
  restarts from the new value (the checkpoint's coefficient is dropped);
- dynamic sampling (`algo.filter_groups`) on or off: the run continues from
  the data iterator's position, which counts the batches drawn either way,
  so no batch is trained on twice;
- a critic added or dropped (`algo.advantage` to or from 'gae'): refused; a
  checkpoint without a critic has no value head to resume, and one with a
  critic would silently lose it;
- the LoRA settings (`model.lora_rank`, `lora_alpha`, `lora_targets`)
  changed: refused; the checkpoint's adapters and their optimizer state are
  of its shape and scale (a different base model is refused by its hash,
  in the Trainer);
- the rollout engine and its pool (`rollout.engine`, `slots`, `refill`):
  speed, not the run; accepted without `allow_config_change`
  (runtime/rundir.py SPEED_ON_RESUME).
Everything else (loss coefficients, the PG loss, clipping, the optimizer's
hyper-parameters) has no state in the checkpoint and takes effect from the
resumed step.
"""

from __future__ import annotations

import dataclasses

from erpo_jax.runtime.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    """ckpt_kl_coef: the checkpoint's state holds an adaptive coefficient;
    kl_coef: 'keep' (the checkpoint's), 'start' (loss.beta_policy) or None
    (the run has none); notes: one line per rule that applies."""

    ckpt_kl_coef: bool
    kl_coef: str | None
    notes: tuple[str, ...]


def plan(old, new) -> ResumePlan:
    """The ResumePlan of resuming a checkpoint made with RunConfig `old` (None:
    unknown, taken as `new`) under RunConfig `new` (both method-resolved).
    ConfigError naming the field for a change that cannot resume."""
    from erpo_jax.rl.recipe import recipe
    if old is None:
        old = new
    ro, rn = recipe(old), recipe(new)
    if ro.needs_critic != rn.needs_critic:
        had = "holds a critic" if ro.needs_critic else "holds no critic"
        raise ConfigError(
            f"config field algo.advantage: the checkpoint was made with "
            f"advantage={old.algo.advantage!r} and {had}, which "
            f"advantage={new.algo.advantage!r} cannot resume ("
            + ("its value head would be dropped" if ro.needs_critic
               else "there is no value head to resume")
            + f"); resume with algo.advantage={old.algo.advantage!r} or start anew with another "
            "train.out_dir.")
    mo, mn = old.model, new.model
    lora_old = (mo.lora_rank, mo.lora_alpha, tuple(mo.lora_targets))
    lora_new = (mn.lora_rank, mn.lora_alpha, tuple(mn.lora_targets))
    if lora_old != lora_new:
        said = lambda m: (f"lora_rank={m.lora_rank}, lora_alpha={m.lora_alpha:g}, "
                          f"lora_targets={list(m.lora_targets)}" if m.lora_rank
                          else "lora_rank=0 (full fine-tuning)")
        raise ConfigError(
            f"config field model.lora_rank: the checkpoint was made with {said(mo)}, and its "
            f"parameters and optimizer state are of that shape; {said(mn)} cannot resume it. "
            "Resume with the checkpoint's LoRA settings or start anew with another "
            "train.out_dir.")
    notes = []
    b_old, b_new = old.loss.beta_policy, new.loss.beta_policy
    kl = None
    if rn.adaptive_kl and not ro.adaptive_kl:
        kl = "start"
        notes.append(f"resume: adaptive KL added, its coefficient starts from "
                     f"loss.beta_policy={b_new:g}")
    elif rn.adaptive_kl and b_old != b_new:
        kl = "start"
        notes.append(f"resume: loss.beta_policy changed ({b_old:g} -> {b_new:g}) on an adaptive "
                     f"run: the controller restarts from {b_new:g}")
    elif rn.adaptive_kl:
        kl = "keep"
    elif ro.adaptive_kl:
        notes.append(f"resume: adaptive KL removed, the checkpoint's coefficient is dropped and "
                     f"Policy-KL is fixed at loss.beta_policy={b_new:g}")
    if ro.filter_groups != rn.filter_groups:
        notes.append("resume: dynamic sampling turned " + ("on" if rn.filter_groups else "off")
                     + ": prompts continue from the data iterator's position")
    return ResumePlan(ckpt_kl_coef=ro.adaptive_kl, kl_coef=kl, notes=tuple(notes))
