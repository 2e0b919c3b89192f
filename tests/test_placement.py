"""Resource pools and the role -> pool map (hybridflow/trainer/placement.py), and the config-time checks
main.validate makes with them: each role's mesh against its own pool, errors naming role, pool and sizes."""

from __future__ import annotations

import pytest

from hybridflow.config.load import load_config
from hybridflow.trainer import placement as P

ALL = ["actor_rollout", "ref", "critic", "reward_model"]


def _trainer(*overrides: str):
    return load_config(None, list(overrides)).trainer


def test_presets_follow_the_paper():
    colocate = P.resolve(_trainer("trainer.n_gpus_per_node=4", "trainer.nnodes=2"), ALL)
    assert colocate.pools == {"colocated": (4, 4)} and colocate.n_devices == 8
    split = P.resolve(_trainer("trainer.placement=split"), ALL)
    assert split.role_pools == {"actor_rollout": "actor_ref", "ref": "actor_ref", "critic": "critic_rm",
                                "reward_model": "critic_rm"}
    assert split.shares_actor_pool("ref") and not split.shares_actor_pool("critic") and split.n_devices == 4
    standalone = P.resolve(_trainer("trainer.placement=standalone"), ALL)
    assert standalone.role_pools == {r: r for r in ALL} and standalone.n_devices == 8
    # a preset only creates the pools its roles use: GRPO without a critic or reward model is one pool in split
    assert P.resolve(_trainer("trainer.placement=split"), ["actor_rollout", "ref"]).pools == {"actor_ref": (2,)}


def test_resource_pools_of_different_sizes():
    t = _trainer("trainer.n_gpus_per_node=2", "trainer.resource_pools.train=[2]", "trainer.resource_pools.small=[1]",
                 "trainer.resource_pools.refpool=[1]", "trainer.role_pools.actor_rollout=train",
                 "trainer.role_pools.critic=small", "trainer.role_pools.ref=refpool")
    place = P.resolve(t, ["actor_rollout", "ref", "critic"])
    assert [place.world(r) for r in ("actor_rollout", "ref", "critic")] == [2, 1, 1]
    assert place.n_devices == 4 and not place.shares_actor_pool("ref")
    assert place.describe("critic") == ("pool 'small' of 1 processes (trainer.resource_pools.small=[1], "
                                        "trainer.role_pools.critic=small)")


@pytest.mark.bad_input
def test_pool_map_errors_name_the_key():
    pools = ("trainer.resource_pools.a=[2]", "trainer.resource_pools.b=[1]")
    with pytest.raises(P.PlacementError, match=r"pool\(s\) \['b'\] are used by no role"):
        P.resolve(_trainer(*pools, "trainer.role_pools.actor_rollout=a", "trainer.role_pools.critic=a"),
                  ["actor_rollout", "critic"])
    with pytest.raises(P.PlacementError, match=r"no pool for role\(s\) \['critic'\].*trainer.role_pools.critic=a"):
        P.resolve(_trainer(*pools, "trainer.role_pools.actor_rollout=a", "trainer.role_pools.ref=b"),
                  ["actor_rollout", "ref", "critic"])
    with pytest.raises(P.PlacementError, match=r"trainer.role_pools.critic='c' is not a pool"):
        P.resolve(_trainer(*pools, "trainer.role_pools.actor_rollout=a", "trainer.role_pools.critic=c"),
                  ["actor_rollout", "critic"])
    with pytest.raises(P.PlacementError, match=r"unknown role\(s\) \['actor'\]"):
        P.resolve(_trainer(*pools, "trainer.role_pools.actor=a"), ["actor_rollout"])
    with pytest.raises(P.PlacementError, match=r"trainer.resource_pools.a=\[3\]: a node holds at most"):
        P.resolve(_trainer("trainer.resource_pools.a=[3]", "trainer.role_pools.actor_rollout=a"), ["actor_rollout"])
    with pytest.raises(P.PlacementError, match=r"spans 2 nodes, but trainer.nnodes=1"):
        P.resolve(_trainer("trainer.resource_pools.a=[1,1]", "trainer.role_pools.actor_rollout=a"), ["actor_rollout"])
    with pytest.raises(P.PlacementError, match="trainer.role_pools=.* but trainer.resource_pools is empty"):
        P.resolve(_trainer("trainer.role_pools.actor_rollout=a"), ["actor_rollout"])
    with pytest.raises(P.PlacementError, match="trainer.placement='spread'; choose one of colocate, split, standalone"):
        P.resolve(_trainer("trainer.placement=spread"), ["actor_rollout"])


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from hybridflow.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("placement")
    data = root / "train.parquet"
    data.write_bytes(b"")  # validate only checks that it exists
    return save_tiny_model(root / "policy"), data


@pytest.mark.bad_input
def test_each_role_mesh_is_checked_against_its_own_pool(policy):
    from hybridflow.trainer.main import validate

    model, data = policy
    base = [f"actor_rollout_ref.model.path={model}", f"data.train_files=[{data}]", "critic.enable=true",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "trainer.resource_pools.train=[2]",
            "trainer.resource_pools.small=[1]", "trainer.role_pools.actor_rollout=train",
            "trainer.role_pools.critic=small"]
    validate(load_config(None, [*base, "critic.megatron.tensor_model_parallel_size=1"]))
    with pytest.raises(ValueError, match=(r"critic.megatron tp\*pp\*cp=2\*1\*1=2 processes is larger than its pool "
                                          r"'small' of 1 processes \(trainer.resource_pools.small=\[1\], "
                                          r"trainer.role_pools.critic=small\)")):
        validate(load_config(None, [*base, "critic.megatron.tensor_model_parallel_size=2"]))
    with pytest.raises(ValueError, match=r"actor_rollout_ref.actor.megatron tp\*pp\*cp=2\*1\*1=2 .* pool 'small'"):
        validate(load_config(None, [*base, "trainer.role_pools.actor_rollout=small", "trainer.role_pools.critic=train",
                                    "critic.megatron.tensor_model_parallel_size=1"]))
    # the ref on a pool of its own may use any layout that fits it; a KL term makes the job run a ref
    kl = ["actor_rollout_ref.actor.use_kl_loss=true", "critic.megatron.tensor_model_parallel_size=1",
          "trainer.resource_pools.refpool=[1]", "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1"]
    with pytest.raises(ValueError, match=r"no pool for role\(s\) \['ref'\]"):
        validate(load_config(None, [*base, *kl[:2]]))
    validate(load_config(None, [*base, *kl, "trainer.role_pools.ref=refpool"]))
    with pytest.raises(ValueError, match=r"ref shares the actor's pool 'train'.*\(1, 1, 1, 1\) must equal"):
        validate(load_config(None, [*base, *kl[:2], "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1",
                                    "trainer.role_pools.ref=train"]))
