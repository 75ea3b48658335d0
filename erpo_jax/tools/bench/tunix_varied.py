"""The peer's `varied` config: `../shared/peers/tunix_grpo.py` at its small
shapes with EOS-varied response lengths. Runs in the peer's venv (it imports
tunix, not erpo_jax):

    PEER_EOS_BIAS=4.37 PEER_NEW_TOKENS=256 tunix-venv/bin/python tunix_varied.py tunix_grpo.py 6

The peer script runs unchanged except for three things, set before its
`main()`: the small config's new tokens (PEER_NEW_TOKENS), no top-k (its
`top_k=50` becomes None: with a near-uniform random model a top-k of 50
would make any EOS bias decide the lengths alone), and PEER_EOS_BIAS added
to the logit of its EOS id 2 where its sampler draws a token (prefill and
decode; the training forward does not see it, as on erpo-jax's side), so
its responses end at EOS with probability about 4 / N per step. `erpo bench --peer tunix --peer-sizes varied` gives erpo-jax the
same bias on its own EOS ids (`bench.rl.bench_trainer(eos_bias=...)`).
"""

import os
import sys


def main() -> None:
  script, iters = sys.argv[1], sys.argv[2]
  bias = float(os.environ["PEER_EOS_BIAS"])
  new_tokens = int(os.environ["PEER_NEW_TOKENS"])
  os.environ["PEER_SIZE"] = "small"
  sys.argv = [script, iters]
  source = open(script).read()
  if source.count("top_k=50,") != 1:
    raise SystemExit(f"{script}: expected one 'top_k=50,' to turn off; the peer changed.")
  source = source.replace("top_k=50,", "top_k=None,")
  peer = {"__name__": "tunix_grpo_varied", "__file__": script}
  exec(compile(source, script, "exec"), peer)  # pylint: disable=exec-used
  peer["NEW_TOKENS"] = new_tokens

  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from tunix.generate import sampler as sampler_lib  # pylint: disable=g-import-not-at-top
  sample = sampler_lib.Sampler._sample  # pylint: disable=protected-access

  def biased(self, logits, *args, **kwargs):
    return sample(self, logits.at[..., 2].add(jnp.float32(bias)), *args, **kwargs)

  sampler_lib.Sampler._sample = biased  # pylint: disable=protected-access
  print(f"varied: small shapes, {new_tokens} new tokens, no top-k, EOS bias {bias}")
  peer["main"]()


if __name__ == "__main__":
  main()
