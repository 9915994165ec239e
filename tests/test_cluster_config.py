"""``tmac.apps.cluster`` without a cluster: the KubeRay manifest's Serve config passes Ray Serve's own schema and its
import path builds the application; the builder refuses what it does not take; a conversation's affinity key stays
the same as it grows; rendezvous hashing moves only a removed replica's conversations."""
import json
import os
import random

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'tmac[cluster]'); make test "
                                        "installs it")
import yaml  # noqa: E402  (Ray's dependency)

from tmac.apps.cluster import affinity_key, build, rendezvous  # noqa: E402

pytestmark = pytest.mark.unit  # needs no compiler (make unit)

MANIFEST = os.path.join(os.path.dirname(__file__), "..", "deploy", "rayservice.yaml")


def test_the_rayservice_manifest_passes_ray_serves_schema_and_builds():
    import ray
    from ray.serve import Application
    from ray.serve.schema import ServeDeploySchema

    manifest = yaml.safe_load(open(MANIFEST))
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    config = ServeDeploySchema.model_validate(yaml.safe_load(manifest["spec"]["serveConfigV2"]))
    (app,) = config.applications
    module, _, name = app.import_path.partition(":")
    assert (module, name) == ("tmac.apps.cluster", "build")
    assert isinstance(build(app.args), Application)
    wanted = tuple(int(x) for x in manifest["spec"]["rayClusterConfig"]["rayVersion"].split(".")[:2])
    assert wanted <= tuple(int(x) for x in ray.__version__.split(".")[:2])  # (the image's Ray, not newer than this)
    for group in [manifest["spec"]["rayClusterConfig"]["headGroupSpec"],
                  *manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]]:
        assert group["template"]["spec"]["containers"][0]["image"]


def test_the_builder_refuses_what_it_does_not_take():
    with pytest.raises(ValueError, match="does not take replica"):
        build({"replica": 2})
    with pytest.raises(ValueError, match="min-replicas 3 and --max-replicas 2"):
        build({"min_replicas": 3, "max_replicas": 2})
    with pytest.raises(ValueError, match="invalid literal"):
        build({"replicas": "two"})


def test_a_conversations_key_stays_as_it_grows():
    turn = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a planet."}]
    later = turn + [{"role": "assistant", "content": "Mars."}, {"role": "user", "content": "Another?"}]
    other = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}]
    key = affinity_key(json.dumps({"messages": turn}).encode())
    assert key and key == affinity_key(json.dumps({"messages": later, "temperature": 0}).encode())
    assert key != affinity_key(json.dumps({"messages": other}).encode())
    assert affinity_key(b'{"prompt": "Once upon"}') == "Once upon"
    assert affinity_key(b"\xff not json") == "" and affinity_key(b"[1]") == ""


def test_rendezvous_moves_only_the_removed_replicas_keys():
    rng = random.Random(0)
    replicas = [f"r{i}" for i in range(4)]
    keys = [f"conversation {rng.random()}" for _ in range(2000)]
    home = {k: rendezvous(k, replicas)[0] for k in keys}
    counts = {r: sum(h == r for h in home.values()) for r in replicas}
    assert min(counts.values()) > 400, counts  # (about a quarter each)
    left = [r for r in replicas if r != "r2"]
    for k in keys:
        new = rendezvous(k, left)[0]
        assert new == home[k] if home[k] != "r2" else new in left


def test_replica_options_give_serve_a_count_or_autoscaling_bounds():
    from ray.serve.config import AutoscalingConfig

    from tmac.apps.cluster import deployment, replica_options

    fixed = replica_options(3, 2, max_batch=4, max_queue=16, min_replicas=None, max_replicas=None)
    assert fixed["num_replicas"] == 3 and fixed["ray_actor_options"] == {"num_cpus": 2}
    assert fixed["max_ongoing_requests"] == 20 and "autoscaling_config" not in fixed
    scaled = replica_options(2, 1, max_batch=8, max_queue=16, min_replicas=1, max_replicas=6)
    bounds = AutoscalingConfig(**scaled["autoscaling_config"])  # (Serve's own validation)
    assert (bounds.min_replicas, bounds.max_replicas, bounds.initial_replicas) == (1, 6, 2)
    assert bounds.target_ongoing_requests == 8 and "num_replicas" not in scaled
    assert replica_options(1, 1, 4, 16, None, 3)["autoscaling_config"]["min_replicas"] == 1
    with pytest.raises(ValueError, match="at least 1"):
        replica_options(0, 1, 4, 16, None, None)
    deployment(None, replicas=2, min_replicas=1, max_replicas=3)  # (Serve takes them)
