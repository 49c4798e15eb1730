"""dj.delays.by_path: per-leaf delay models from pytree paths, by regular expression or by a function."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from delayjax import delays

Pair = collections.namedtuple("Pair", "kernel bias")
PARAMS = {"embed": jnp.ones(3), "blocks": [Pair(jnp.ones((3, 3)), jnp.ones(3)), Pair(jnp.ones((3, 3)), jnp.ones(3))],
          "head": jnp.ones(3)}


def test_path_names_join_keys_attributes_and_indices():
  names = [delays.path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(PARAMS)]
  assert names == ["blocks/0/kernel", "blocks/0/bias", "blocks/1/kernel", "blocks/1/bias", "embed", "head"]


def test_the_first_matching_pattern_gives_the_delay_and_unmatched_leaves_the_default():
  tree = delays.by_path(PARAMS, [(r"^blocks/0/", 2), (r"bias$", delays.uniform(4)), (r"^embed", 3)], default=1)
  assert tree["blocks"][0] == Pair(delays.constant(2), delays.constant(2))  # first rule wins over "bias$"
  assert tree["blocks"][1] == Pair(delays.constant(1), delays.uniform(4))
  assert tree["embed"] == delays.constant(3) and tree["head"] == delays.constant(1)


def test_a_function_of_the_path_gives_a_stage_profile():
  # marin's profile: with P stages the first is stalest (P - 1), the output side fresh.
  def stage(name):
    if name.startswith("blocks/"):
      return 1 - int(name.split("/")[1])
    return 2 if name == "embed" else 0

  tree = delays.by_path(PARAMS, stage)
  assert [m.tau for m in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, delays.DelayModel))] == [
      1, 1, 0, 0, 2, 0]


@pytest.mark.standard_promotion
def test_delayed_with_by_path_is_delayed_with_the_same_tree_written_by_hand():
  rules = {r"^blocks/0/": 2, r"^embed": 3}
  by_hand = delays.per_leaf({"embed": delays.constant(3), "head": delays.constant(0),
                             "blocks": [Pair(delays.constant(2), delays.constant(2)),
                                        Pair(delays.constant(0), delays.constant(0))]})

  def train(model):
    tx = dj.delayed(optax.adam(0.1), model)
    p, s = PARAMS, tx.init(PARAMS)
    for t in range(6):
      u, s = tx.update(jax.tree.map(lambda x: jnp.sin(x * (t + 1.0)), p), s, p)
      p = optax.apply_updates(p, u)
    return p

  got, expected = train(delays.per_leaf(delays.by_path(PARAMS, rules))), train(by_hand)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
    np.testing.assert_array_equal(a, b)
  # The embedding (delay 3) and the head (no delay) moved differently: the delays reached the leaves.
  assert not np.allclose(got["embed"], got["head"])


@pytest.mark.parametrize("rules, default, exc, match", [
    ({"(": 1}, 0, ValueError, "pattern '\\(' is not a regular expression"),
    ({"w": 1.5}, 0, TypeError, "the delay of pattern 'w' must be an integer delay"),
    ({"w": -1}, 0, ValueError, "the delay of pattern 'w' must be an integer >= 0"),
    ([("w", 1, 2)], 0, TypeError, "rule 0 is"),
    ({"w": 1}, delays.per_leaf({"a": delays.constant(1)}), TypeError, "default must be one delay model"),
    (lambda name: "x", 0, TypeError, "the delay rules\\('blocks/0/kernel'\\) returned must be"),
])
def test_bad_rules_are_refused_by_name(rules, default, exc, match):
  with pytest.raises(exc, match=match):
    delays.by_path(PARAMS, rules, default)
