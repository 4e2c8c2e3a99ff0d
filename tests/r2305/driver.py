"""Load a published repository's Python models against the r23.05 API and run a scenario.

Run as ``python -S driver.py SPEC.json`` with the interpreter of the virtualenv that holds the
Triton image's pins (``.venv-triton``; ``-S``: the project's own ``loader`` package is not
importable, so each model runs from the files the repository writer copied next to it). SPEC
holds ``site`` (that virtualenv's site-packages), ``models`` (name, version directory,
``model_config`` JSON as Triton passes it), ``gpu_output_models`` (models whose outputs are GPU
tensors: the FasterTransformer backend's), ``ensemble`` (the ensemble's config, when the
repository has one), ``streaming`` (the model clients call, when it is a decoupled Python
model), ``scenario`` and its ``requests``. Prints one JSON object: what the scenario saw.

Scenarios:

* ``ensemble``: each request through the ensemble's steps as Triton's ensemble scheduler runs
  them (``input_map``/``output_map``; a step output the ensemble maps but the model did not send
  fails the request, as "unexpected deadlock" does);
* ``streaming``: each request through the decoupled model clients call;
* ``batch``: the requests (``fastertransformer`` inputs) as ONE ``execute`` call of the
  ``fastertransformer`` model, as Triton's dynamic batcher hands a batch over;
* ``llm``: each request through the decoupled ``llm`` model (Triton's LLM convention): every
  response's outputs, error and final flag.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: Triton's type names -> numpy dtype names (the spec's requests are JSON).
DTYPES = {
    "BYTES": "object",
    "BOOL": "bool",
    "UINT32": "uint32",
    "UINT64": "uint64",
    "INT32": "int32",
    "FP32": "float32",
}


def load_model(name: str, version_dir: Path, config: dict) -> object:
    """Import ``version_dir/model.py`` the way the stub does and call ``initialize``."""
    sys.path.insert(0, str(version_dir))
    for cached in [
        m for m in sys.modules if m in ("tokenization", "loader") or m.startswith("loader.")
    ]:
        del sys.modules[cached]
    spec = importlib.util.spec_from_file_location(f"model_{name}", version_dir / "model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    sys.path.remove(str(version_dir))
    instance = module.TritonPythonModel()
    instance.initialize(
        {
            "model_config": json.dumps(config),
            "model_instance_kind": "CPU",
            "model_instance_name": f"{name}_0",
            "model_instance_device_id": "0",
            "model_repository": str(version_dir.parent),
            "model_version": version_dir.name,
            "model_name": name,
        }
    )
    return instance


def _tensors(np, pb_utils, request: dict) -> list:
    """``{name: [dtype, values]}`` -> ``pb_utils.Tensor`` list (values nested by row)."""
    tensors = []
    for name, (dtype, values) in request.items():
        if dtype == "BYTES" and values and isinstance(values[0], list):  # rows of strings
            array = np.empty((len(values), len(values[0])), dtype=np.object_)
            array[:] = [[v.encode() for v in row] for row in values]
        elif dtype == "BYTES":
            array = np.array([[v.encode()] for v in values], dtype=np.object_)
        else:
            array = np.array(values, dtype=DTYPES[dtype])
        tensors.append(pb_utils.Tensor(name, array))
    return tensors


def _plain(value):
    """A numpy value -> JSON (NaN as None, bytes decoded)."""
    import numpy as np

    array = np.asarray(value)
    if array.dtype == np.object_:
        return [[v.decode() for v in row] for row in array.reshape(array.shape[0], -1)]
    if array.dtype.kind == "f":
        return [None if np.isnan(v) else float(v) for v in array.reshape(-1)]
    return array.tolist()


def _outputs(pb_utils, response) -> dict:
    return {t.name(): pb_utils.data(t) for t in response.output_tensors()}


def run_ensemble(np, pb_utils, ensemble: dict, request: dict) -> dict:
    tensors = {t.name(): pb_utils.data(t) for t in _tensors(np, pb_utils, request)}
    produced_by: dict[str, list[str]] = {}
    for step in ensemble["ensemble_scheduling"]["step"]:
        inputs = [
            pb_utils.Tensor(model_input, tensors[name])
            for model_input, name in step["input_map"].items()
            if name in tensors
        ]
        response = pb_utils.InferenceRequest(
            inputs=inputs, requested_output_names=[], model_name=step["model_name"]
        ).exec()
        if response.has_error():
            return {"error": f"{step['model_name']}: {response.error().message()}"}
        produced = _outputs(pb_utils, response)
        produced_by[step["model_name"]] = sorted(produced)
        for model_output, name in step["output_map"].items():
            if model_output not in produced:
                return {"error": f"{step['model_name']} did not send {model_output}"}
            tensors[name] = produced[model_output]
    outputs = {o["name"]: tensors[o["name"]] for o in ensemble["output"]}
    return {
        "dtypes": {k: str(v.dtype) for k, v in outputs.items()},
        "shapes": {k: list(v.shape) for k, v in outputs.items()},
        "outputs": {k: _plain(v) for k, v in outputs.items()},
        "produced": produced_by,
    }


def run_streaming(np, pb_utils, model_name: str, request: dict) -> dict:
    model, _ = pb_utils.MODELS[model_name]
    ir = pb_utils.InferenceRequest(
        inputs=_tensors(np, pb_utils, request), requested_output_names=[], model_name=model_name
    )
    model.execute([ir])
    sender = ir.get_response_sender()
    final = pb_utils.wait_final(sender, 120)
    responses = pb_utils.sent(sender)
    data = [(r, f) for r, f in responses if r is not None and not r.has_error()]
    last, flags = responses[-1]
    return {
        "final": final,
        "responses": len(responses),
        "errors": [r.error().message() for r, _ in responses if r and r.has_error()],
        "final_has_data": bool(flags) and last is not None and bool(last.output_tensors()),
        "completion": "".join(
            pb_utils.get_output_tensor_by_name(r, "completion").as_numpy()[0, 0].decode()
            for r, _ in data
        ),
        "sequence_lengths": [
            int(pb_utils.get_output_tensor_by_name(r, "sequence_length").as_numpy()[0, 0])
            for r, _ in data
        ],
    }


def run_llm(np, pb_utils, request: dict) -> dict:
    model, _ = pb_utils.MODELS["llm"]
    ir = pb_utils.InferenceRequest(
        inputs=_tensors(np, pb_utils, request), requested_output_names=[], model_name="llm"
    )
    model.execute([ir])
    sender = ir.get_response_sender()
    final = pb_utils.wait_final(sender, 120)
    entries = []
    for response, flags in pb_utils.sent(sender):
        entry = {"final": bool(flags)}
        if response is None:
            entry["empty"] = True
        elif response.has_error():
            entry["error"] = response.error().message()
        else:
            outputs = _outputs(pb_utils, response)
            entry["outputs"] = {k: _plain(v) for k, v in outputs.items()}
            entry["dtypes"] = {k: str(v.dtype) for k, v in outputs.items()}
            entry["shapes"] = {k: list(v.shape) for k, v in outputs.items()}
        entries.append(entry)
    return {"final": final, "responses": entries}


def run_batch(np, pb_utils, requests: list[dict]) -> list[dict]:
    """The requests as one ``execute`` of ``fastertransformer`` (decoupled or not)."""
    model, decoupled = pb_utils.MODELS["fastertransformer"]
    irs = [
        pb_utils.InferenceRequest(
            inputs=_tensors(np, pb_utils, r), requested_output_names=[], model_name="x"
        )
        for r in requests
    ]
    returned = model.execute(irs)
    report = []
    for n, ir in enumerate(irs):
        responses = pb_utils.sent(ir.get_response_sender()) if decoupled else [(returned[n], 1)]
        entries = []
        for response, flags in responses:
            entry = {"final": bool(flags)}
            if response is None:
                entry["empty"] = True
            elif response.has_error():
                entry["error"] = response.error().message()
            else:
                entry["outputs"] = {k: _plain(v) for k, v in _outputs(pb_utils, response).items()}
                entry["shapes"] = {
                    k: list(v.shape) for k, v in _outputs(pb_utils, response).items()
                }
            entries.append(entry)
        report.append({"responses": entries})
    return report


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    sys.path[:0] = [str(HERE), spec["site"]]
    import numpy as np
    import triton_python_backend_utils as pb_utils

    pb_utils.GPU_OUTPUT_MODELS.update(spec.get("gpu_output_models", []))
    for model in spec["models"]:
        config = model["model_config"]
        decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled", False))
        instance = load_model(model["name"], Path(model["version_dir"]), config)
        pb_utils.MODELS[model["name"]] = (instance, decoupled)

    import tokenizers

    report: dict[str, object] = {
        "numpy": np.__version__,
        "tokenizers": tokenizers.__version__,
        "python": sys.version.split()[0],
    }
    scenario, requests = spec["scenario"], spec["requests"]
    if scenario == "ensemble":
        report["results"] = [run_ensemble(np, pb_utils, spec["ensemble"], r) for r in requests]
    elif scenario == "streaming":
        report["results"] = [run_streaming(np, pb_utils, spec["streaming"], r) for r in requests]
    elif scenario == "llm":
        report["results"] = [run_llm(np, pb_utils, r) for r in requests]
    elif scenario == "batch":
        report["results"] = run_batch(np, pb_utils, requests)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    for model in spec["models"]:
        instance, _ = pb_utils.MODELS[model["name"]]
        if hasattr(instance, "finalize"):
            instance.finalize()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
