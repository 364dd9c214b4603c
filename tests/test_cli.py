"""Process-level set-up the command line does before any engine exists."""
import pytest

from jaxoverlap.cli import DEVICE_MEMORY_FRACTION, claim_device_memory, main


def test_the_commands_claim_most_of_the_gpu_unless_told_otherwise():
    env = {}
    claim_device_memory(DEVICE_MEMORY_FRACTION, env)
    assert env == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}  # not JAX's 0.75
    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.45"}  # e.g. two engines sharing a card
    claim_device_memory(0.8, env)
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.45"
    for bad in (0.0, 1.5, -0.2):
        with pytest.raises(SystemExit, match="device-memory-fraction"):
            claim_device_memory(bad, {})


def test_an_impossible_fraction_is_refused_before_anything_loads(capsys):
    with pytest.raises(SystemExit, match="device-memory-fraction"):
        main(["generate", "hi", "--device-memory-fraction", "2"])
