"""libgomp wait defaults for the runtimes' compute threads: ours only where
the user set none, and each runtime's own count in a process that inherited
another's default (backends/openmp.py)."""

from modeld.backends.openmp import LLAMACPP_SPIN_COUNT, TORCH_SPIN_COUNT, wait_defaults


def test_unset_gets_passive_with_a_short_spin():
    env = {}
    wait_defaults(env, LLAMACPP_SPIN_COUNT)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "300", "MODELD_OMP_DEFAULTS": "1"}
    assert TORCH_SPIN_COUNT == 3000


def test_user_policy_is_kept_and_adds_no_spin():
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    wait_defaults(env, LLAMACPP_SPIN_COUNT)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}
    env = {"OMP_WAIT_POLICY": "PASSIVE"}
    wait_defaults(env, TORCH_SPIN_COUNT)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_user_spin_count_is_kept():
    env = {"GOMP_SPINCOUNT": "0"}
    wait_defaults(env, TORCH_SPIN_COUNT)
    assert env == {"GOMP_SPINCOUNT": "0", "OMP_WAIT_POLICY": "PASSIVE"}


def test_a_default_inherited_from_another_runtime_is_replaced():
    # a torch worker spawned by a daemon that set llama.cpp's default for itself
    env = {}
    wait_defaults(env, LLAMACPP_SPIN_COUNT)
    wait_defaults(env, TORCH_SPIN_COUNT)
    assert env["GOMP_SPINCOUNT"] == "3000" and env["OMP_WAIT_POLICY"] == "PASSIVE"
    wait_defaults(env, LLAMACPP_SPIN_COUNT)
    assert env["GOMP_SPINCOUNT"] == "300"
