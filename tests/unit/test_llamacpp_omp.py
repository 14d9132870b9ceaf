"""libgomp wait defaults for llama.cpp's threads: ours only where the user set none."""

from modeld.backends.llamacpp.context import DEFAULT_SPIN_COUNT, omp_defaults


def test_unset_gets_passive_with_a_short_spin():
    env = {}
    omp_defaults(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": str(DEFAULT_SPIN_COUNT)}
    assert DEFAULT_SPIN_COUNT == 300


def test_user_policy_is_kept_and_adds_no_spin():
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    omp_defaults(env)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}
    env = {"OMP_WAIT_POLICY": "PASSIVE"}
    omp_defaults(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_user_spin_count_is_kept():
    env = {"GOMP_SPINCOUNT": "0"}
    omp_defaults(env)
    assert env == {"GOMP_SPINCOUNT": "0", "OMP_WAIT_POLICY": "PASSIVE"}
