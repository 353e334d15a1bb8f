"""Choosing ONNX Runtime's device: the devices listed, the whole-graph check, the remembered
verdict, and what `auto` and `devices` make of them.

This machine has no NPU. The real paths run on what it has: the CPU device ONNX Runtime lists, and
an NPU provider this onnxruntime build lacks, which ONNX Runtime refuses with CPU fallback disabled
exactly as an NPU refuses a graph it cannot take. Only an NPU that takes the whole graph is faked,
at the hardware boundary: the session's report of where each node runs.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from localinfer import backends
from localinfer.backends.onnx import devices as onnx_devices, npu as onnx_npu
from localinfer.backends.onnx.devices import Target, Verdict

from helpers import run_cli

pytestmark = pytest.mark.slow
MISSING_NPU = Target("QNNExecutionProvider", "NPU", "Qualcomm")   # not in this onnxruntime build


@pytest.fixture
def fresh_decisions(monkeypatch):
    monkeypatch.setattr(onnx_npu, "_decided", {})


@pytest.fixture
def checked_graphs(smollm_path, in_models_home):
    return onnx_npu._check_graphs(smollm_path)


def test_the_cpu_is_listed_as_a_cpu_device():
    cpu = [t for t in onnx_devices.targets() if t.provider == "CPUExecutionProvider"]
    assert len(cpu) == 1 and cpu[0].kind == "CPU" and cpu[0].ep_device is not None
    assert onnx_devices.npu_targets() == []


def test_a_provider_that_cannot_take_the_graph_is_refused_with_where_the_nodes_went(checked_graphs):
    _, _, graphs = checked_graphs
    verdict = onnx_devices.check(MISSING_NPU, graphs, threads=2)
    assert not verdict.whole
    assert "fallback to CPU EP has been explicitly disabled" in verdict.detail
    assert "nodes not on QNNExecutionProvider" in verdict.detail and "MatMulNBits" in verdict.detail


def test_the_cpu_provider_takes_every_node(checked_graphs):
    _, _, graphs = checked_graphs
    session = onnx_devices.open_session(graphs[1], onnx_devices.CPU, threads=1)
    assert session.get_providers() == ["CPUExecutionProvider"]


def test_a_verdict_is_remembered_per_export_and_device(tmp_path):
    other = Target("QNNExecutionProvider", "NPU", "Qualcomm", device_id=1)
    onnx_devices.remember(tmp_path, MISSING_NPU, "key1", Verdict(False, "no GroupQueryAttention"))
    assert onnx_devices.remembered(tmp_path, MISSING_NPU, "key1") == \
        Verdict(False, "no GroupQueryAttention")
    assert onnx_devices.remembered(tmp_path, MISSING_NPU, "key2") is None
    assert onnx_devices.remembered(tmp_path, other, "key1") is None
    (tmp_path / onnx_devices.VERDICTS).write_text("{not json")
    assert onnx_devices.remembered(tmp_path, MISSING_NPU, "key1") is None      # checked again
    onnx_devices.remember(tmp_path, MISSING_NPU, "key1", Verdict(True, "all"))
    assert onnx_devices.remembered(tmp_path, MISSING_NPU, "key1") == Verdict(True, "all")


def test_auto_passes_over_an_npu_that_cannot_take_the_model(smollm_path, checked_graphs,
                                                            monkeypatch, fresh_decisions):
    folder, key, _ = checked_graphs
    (folder / onnx_devices.VERDICTS).unlink(missing_ok=True)
    monkeypatch.setattr(onnx_npu, "npu_installed", lambda: ["onnxruntime-qnn"])
    monkeypatch.setattr(onnx_devices, "targets", lambda: [onnx_devices.CPU, MISSING_NPU])
    _, choice = backends.select("auto", "llama", smollm_path)
    assert choice.backend == "llama.cpp"
    assert "QNNExecutionProvider on the Qualcomm NPU does not run the whole graph" in choice.reason
    assert onnx_devices.remembered(folder, MISSING_NPU, key).whole is False


def test_auto_takes_onnx_where_the_npu_runs_every_node(smollm_path, checked_graphs, monkeypatch,
                                                       fresh_decisions):
    npu = Target("FakeNpuExecutionProvider", "NPU", "Contoso")
    folder, key, _ = checked_graphs
    opened = []

    class WholeOnTheNpu:            # the device's report: every node placed on it
        def get_provider_graph_assignment_info(self):
            node = type("Node", (), {"op_type": "MatMulNBits"})()
            return [type("Sub", (), {"ep_name": npu.provider, "get_nodes": lambda s: [node]})()]

    def fake_open(graph, target, threads, *, strict=False, config=None):
        opened.append((graph.name, strict))
        return WholeOnTheNpu()

    (folder / onnx_devices.VERDICTS).unlink(missing_ok=True)
    monkeypatch.setattr(onnx_npu, "npu_installed", lambda: ["onnxruntime-qnn"])
    monkeypatch.setattr(onnx_devices, "targets", lambda: [onnx_devices.CPU, npu])
    monkeypatch.setattr(onnx_devices, "open_session", fake_open)
    chosen, choice = backends.select("auto", "llama", smollm_path)
    assert chosen.name == "onnx" and choice.reason.startswith("the preferred backend")
    assert opened == [("static-a4-t64-c512.onnx", True), ("static-a4-t1-c512.onnx", True)]
    assert onnx_devices.remembered(folder, npu, key).whole
    monkeypatch.setattr(onnx_npu, "_decided", {})
    opened.clear()
    assert onnx_npu.decide(smollm_path).target == npu and opened == []   # remembered, not rerun
    (folder / onnx_devices.VERDICTS).unlink()


def test_without_an_npu_build_auto_does_not_import_onnxruntime(models_home):
    code = ("import sys; from localinfer import backends; from pathlib import Path; "
            f"backends.select('auto', 'llama', Path({str(models_home / 'data/models')!r}) / "
            "'smollm2-135m-instruct/smollm2-135m-instruct-Q4_1.gguf'); "
            "print('onnxruntime' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_devices_lists_onnx_devices_and_why(models_home):
    result = run_cli("devices", "--json")
    assert result.returncode == 0, result.stderr
    onnx = json.loads(result.stdout)["backends"]["onnx"]
    cpu = [d for d in onnx["devices"] if d["type"] == "CPU"]
    assert cpu and cpu[0]["provider"] == "CPUExecutionProvider" and "auto" in cpu[0]["auto"]
    table = run_cli("devices")
    assert "onnx CPU" in table.stdout and "--backend onnx runs here" in table.stdout


def test_a_plugin_library_that_does_not_load_is_reported_not_fatal(models_home):
    env = {onnx_devices.LIBRARIES_ENV: "ContosoExecutionProvider=/nonexistent/libcontoso.so"}
    result = run_cli("devices", env=env)
    assert result.returncode == 0, result.stderr
    assert "ContosoExecutionProvider: [ONNXRuntimeError]" in result.stdout
    assert "onnxruntime here lists no NPU device" in result.stdout
    ran = run_cli("run", "smollm2", "Hi", "-n", "2", "--offline", env=env)
    assert ran.returncode == 0, ran.stderr
