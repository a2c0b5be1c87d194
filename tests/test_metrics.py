"""gpt/metrics.py: throughput/MFU arithmetic, the metrics log across resumes and crashes, the plot,
and the measured ceilings (values sane, never timed against a threshold)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import REPO
from gpt.metrics import (MetricsLog, Throughput, device_name, measure_copy_gbps, measure_matmul_tflops,
                         measure_read_gbps, to_host, vendor_peak_tflops)


def test_throughput_arithmetic():
    t = Throughput(flops_per_token=6e6, ceiling_tflops=0.5, vendor_tflops=2.0, n_devices=2)
    r = t(tokens=10_000, seconds=2.0)
    assert r["tokens_per_sec"] == 5000
    assert r["model_tflops"] == pytest.approx(5000 * 6e6 / 1e12)
    assert r["mfu"] == pytest.approx(r["model_tflops"] / 2 / 0.5)  # per device, over the ceiling
    assert r["mfu_vendor"] == pytest.approx(r["model_tflops"] / 2 / 2.0)
    none = Throughput(6e6, None, None)(100, 0.0)  # no ceilings; zero time does not divide by zero
    assert none["mfu"] is None and none["mfu_vendor"] is None and np.isfinite(none["tokens_per_sec"])


def test_log_resume_drops_later_and_torn_lines(tmp_path):
    log = MetricsLog(tmp_path, tensorboard=False)
    for step in (10, 20, 30):
        log.write({"kind": "train", "step": step, "loss": 1.0 / step})
    with open(log.path, "a") as f:
        f.write('{"kind": "train", "step": 4')  # a line torn by a crash mid-write
    assert [r["step"] for r in log.records()] == [10, 20, 30]
    resumed = MetricsLog(tmp_path, resume_step=20, tensorboard=False)
    assert [r["step"] for r in resumed.records()] == [10, 20]
    assert log.path.read_text().endswith("\n")  # the torn line is gone, not glued to the next
    MetricsLog(tmp_path, tensorboard=False)  # a fresh run starts a fresh log
    assert not log.path.exists()


def test_log_is_strict_json(tmp_path):
    """NaN and infinities (a diverging step's grad norm) are written as null, which every JSON
    reader takes; Python's NaN/Infinity tokens are not JSON."""
    log = MetricsLog(tmp_path, tensorboard=False)
    log.write({"kind": "train", "step": 1, "loss": 2.0, "grad_norm": float("inf"),
               "moe_load": {"layer1": [0.5, float("nan")]}})
    record = json.loads(log.path.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the log"))
    assert record["grad_norm"] is None and record["moe_load"] == {"layer1": [0.5, None]}


def test_disabled_log_writes_nothing(tmp_path):
    log = MetricsLog(tmp_path, enabled=False)
    log.write({"kind": "train", "step": 1, "loss": 2.0})
    log.plot()
    assert list(tmp_path.iterdir()) == []


def test_plot_and_tensorboard_events(tmp_path):
    log = MetricsLog(tmp_path)
    log.write({"kind": "train", "step": 1, "loss": 3.0, "lr": 1e-3})
    log.write({"kind": "eval", "step": 1, "train_loss": 2.9, "val_loss": 3.1})
    log.plot()
    log.close()
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any(p.name.startswith("events.out.tfevents") for p in tmp_path.iterdir())
    assert json.loads(log.path.read_text().splitlines()[0])["lr"] == 1e-3


def _events(path):
    """The Event protos of one TensorBoard file (TFRecords: length, its CRC, data, its CRC)."""
    import struct
    from tensorboardX.proto import event_pb2
    data, at, out = path.read_bytes(), 0, []
    while at < len(data):
        (n,) = struct.unpack("<Q", data[at:at + 8])
        out.append(event_pb2.Event.FromString(data[at + 12:at + 12 + n]))
        at += 12 + n + 4
    return out


def test_a_resumed_log_has_tensorboard_drop_the_recomputed_steps(tmp_path):
    """A crash after the checkpoint at step 20 left events up to 30 in the old file; the resumed
    run's file opens with a START at step 21, from which TensorBoard discards the old files' events
    (metrics.jsonl drops those lines itself)."""
    log = MetricsLog(tmp_path)
    for step in range(5, 31, 5):
        log.write({"kind": "train", "step": step, "loss": 3.0})
    log.close()
    first = set(tmp_path.glob("events.out.tfevents.*"))
    time.sleep(1.1)  # event file names carry the second they were opened
    log = MetricsLog(tmp_path, resume_step=20)
    log.write({"kind": "train", "step": 25, "loss": 2.0})
    log.close()
    assert [r["step"] for r in log.records()] == [5, 10, 15, 20, 25]
    (new,) = set(tmp_path.glob("events.out.tfevents.*")) - first
    starts = [e.step for e in _events(new) if e.HasField("session_log")]
    assert starts == [21]
    fresh = tmp_path / "fresh"
    MetricsLog(fresh).close()
    assert not any(e.HasField("session_log") for p in fresh.glob("events.*") for e in _events(p))


def test_tensorboard_events_without_loading_torch(tmp_path):
    """tensorboardX imports torch where it is installed (1.3-1.7 s of every training start on a
    2-core CPU); the metrics log keeps torch out, and leaves it importable afterwards."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed: nothing to keep out")
    script = ("import sys; from gpt.metrics import MetricsLog; log = MetricsLog(sys.argv[1]); "
              "log.write({'kind': 'train', 'step': 1, 'loss': 3.0}); log.close(); "
              "print('torch' in sys.modules); import torch; print(torch.ones(1).item())")
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["False", "1.0"], r.stderr
    assert any(p.name.startswith("events.out.tfevents") for p in tmp_path.iterdir())


def test_measured_ceilings_and_names_are_sane():
    assert 0 < measure_matmul_tflops(jnp.float32, n=128, reps=2) < 1e4
    assert 0 < measure_copy_gbps(n_bytes=1 << 20, reps=2) < 1e5
    assert 0 < measure_read_gbps(n_bytes=1 << 20, reps=2) < 1e5
    assert device_name()
    assert vendor_peak_tflops("float32") is None or vendor_peak_tflops("float32") > 0
    assert to_host({"a": jnp.array(1.5), "b": np.float32(2)}) == {"a": 1.5, "b": 2.0}


@pytest.mark.parametrize("kind, peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                        ("NVIDIA H100 NVL", 835.0), ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0),
                                        ("NVIDIA L40S", 362.0), ("NVIDIA L40", 181.0), ("NVIDIA L4", 121.0),
                                        ("NVIDIA B9", None)])
def test_vendor_peak_by_device_kind(monkeypatch, kind, peak):
    """A variant before its family: the PCIe H100 peaks at 756 TFLOP/s, not the SXM card's 989, and
    an L40S is not an L4 (its MFU was understated, theirs inflated)."""
    from types import SimpleNamespace
    import gpt.metrics as metrics
    monkeypatch.setattr(metrics.jax, "devices", lambda: [SimpleNamespace(platform="gpu", device_kind=kind)])
    assert metrics.vendor_peak_tflops("bfloat16") == peak
