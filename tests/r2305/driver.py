"""Load a published repository's Python models against the r23.05 API and run one request.

Run as ``python -S driver.py SPEC.json`` (``-S``: the project's own ``loader`` package is not
importable, so each model runs from the files the repository writer copied next to it). SPEC
holds ``site`` (where numpy and tokenizers live), ``models`` (name, version directory,
``model_config`` JSON as Triton passes it), ``streaming`` (the model clients call, when it is a
decoupled Python model) and ``prompt``. Prints one JSON object: what each step returned.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


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


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    sys.path[:0] = [str(HERE), spec["site"]]
    import numpy as np
    import triton_python_backend_utils as pb_utils

    for model in spec["models"]:
        config = model["model_config"]
        decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled", False))
        instance = load_model(model["name"], Path(model["version_dir"]), config)
        pb_utils.MODELS[model["name"]] = (instance, decoupled)

    prompt = pb_utils.Tensor("prompt", np.array([[spec["prompt"].encode()]], dtype=np.object_))
    length = pb_utils.Tensor("request_output_len", np.array([[6]], dtype=np.uint32))
    greedy = pb_utils.Tensor("runtime_top_k", np.array([[1]], dtype=np.uint32))
    report: dict[str, object] = {}
    if spec.get("streaming"):
        model, _ = pb_utils.MODELS[spec["streaming"]]
        request = pb_utils.InferenceRequest(
            inputs=[prompt, length, greedy], requested_output_names=[], model_name=spec["streaming"]
        )
        model.execute([request])
        sender = request.get_response_sender()
        report["final"] = pb_utils.wait_final(sender, 120)
        responses = pb_utils.sent(sender)
        report["responses"] = len(responses)
        report["errors"] = [r.error().message() for r, _ in responses if r and r.has_error()]
        last, flags = responses[-1]
        report["final_has_data"] = bool(flags) and last is not None and bool(last.output_tensors())
        report["completion"] = "".join(
            pb_utils.get_output_tensor_by_name(r, "completion").as_numpy()[0, 0].decode()
            for r, _ in responses
            if r is not None and not r.has_error()
        )
        model.finalize()
    else:

        def run(name: str, inputs: list) -> object:
            request = pb_utils.InferenceRequest(
                inputs=inputs, requested_output_names=[], model_name=name
            )
            response = request.exec()
            if response.has_error():
                raise RuntimeError(f"{name}: {response.error().message()}")
            return {t.name(): t.as_numpy() for t in response.output_tensors()}

        pre = run("preprocessing", [prompt])
        ft = run(
            "fastertransformer",
            [pb_utils.Tensor(k, v) for k, v in pre.items()] + [length, greedy],
        )
        post = run(
            "postprocessing",
            [pb_utils.Tensor(k, v) for k, v in ft.items()]
            + [pb_utils.Tensor("input_lengths", pre["input_lengths"])],
        )
        report["dtypes"] = {k: str(v.dtype) for k, v in {**ft, **post}.items()}
        report["completion"] = post["completion"][0, 0].decode()
        report["sequence_length"] = int(post["sequence_length"].reshape(-1)[0])
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
