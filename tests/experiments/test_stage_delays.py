"""experiments.weight_prediction.stage_delays: marin's per-stage pipeline profile from parameter paths."""

import jax

import delayjax as dj
from experiments._models import transformer_lm
from experiments.weight_prediction import stage_delays


def test_the_stage_profile_of_a_small_transformer():
  init, _ = transformer_lm(16, 16, 4, 2, 8)
  shapes = jax.eval_shape(init, jax.random.PRNGKey(0))
  tree = stage_delays(shapes, depth=4, stages=3, delay_per_stage=2)
  tau = {dj.delays.path_name(path): m.tau for path, m in jax.tree_util.tree_leaves_with_path(
      tree, is_leaf=lambda x: isinstance(x, dj.delays.DelayModel))}
  # marin's grug_stage_tau: block i in stage i * P // L, delayed (P - 1 - stage); inputs stalest, outputs fresh.
  for i in range(4):
    expected = (3 - 1 - i * 3 // 4) * 2
    assert {v for k, v in tau.items() if k.startswith(f"_DecoderBlock_{i}/")} == {expected}
  assert tau["Embed_0/embedding"] == tau["Embed_1/embedding"] == 4
  assert tau["Dense_0/kernel"] == tau["LayerNorm_0/scale"] == 0
