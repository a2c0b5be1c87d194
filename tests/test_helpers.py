"""The tests' own XLA flags (tests/helpers.py, set by tests/conftest.py)."""
import os

from helpers import TEST_XLA_FLAGS, USER_XLA_FLAGS_ENV, takes_silently, user_xla_flags, xla_flags


def test_tests_compile_with_their_flags_and_users_without(monkeypatch):
    """Every test process has an optimisation level (ours, -O0, unless the developer set one); a
    user's run compiles with the developer's flags as they were before ours, and subprocesses get a
    device count in place of any other."""
    assert any(f.startswith("--xla_backend_optimization_level=") for f in os.environ["XLA_FLAGS"].split())
    count = "--xla_force_host_platform_device_count"
    monkeypatch.setenv(USER_XLA_FLAGS_ENV, f"--xla_dump_to=/d {count}=8")
    monkeypatch.setenv("XLA_FLAGS", f"--xla_dump_to=/d {count}=8 {TEST_XLA_FLAGS}")
    assert user_xla_flags() == f"--xla_dump_to=/d {count}=8"
    assert xla_flags(4, as_users=True) == f"--xla_dump_to=/d {count}=4"
    assert xla_flags(2) == f"--xla_dump_to=/d {TEST_XLA_FLAGS} {count}=2"


def test_flags_this_xla_would_refuse_or_warn_about_are_not_taken():
    """An unknown flag aborts XLA and a retired one prints a warning (the one-line error tests would
    see it on stderr): conftest then keeps only the -O0 level instead of failing every test."""
    assert not takes_silently("--xla_cpu_no_such_flag=true")
    assert not takes_silently("--xla_cpu_use_thunk_runtime=false")  # retired: "no longer supported"
    assert takes_silently(TEST_XLA_FLAGS.split()[0])
