"""``scripts/bench_llm.py`` (``make bench-llm``): the request AIPerf sends and what is read back.

AIPerf itself is not run here (its own 1.2 GB virtualenv, ``scripts/tools/install-aiperf.sh``);
the request body it renders is checked against ``llm``'s inputs, and the committed results are
checked against AIPerf's own export they were read from.
"""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import jinja2

from loader.completion import load_request
from loader.repository.tensors import LLM_INPUTS

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "llm"


def _script():
    spec = importlib.util.spec_from_file_location("bench_llm", ROOT / "scripts" / "bench_llm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_body_aiperf_renders_is_an_llm_request_with_bench_test_jsons_fields():
    bench = _script()
    prompt, fields = bench.seed_fields(ROOT / "bench" / "test.json")
    seed = load_request(ROOT / "bench" / "test.json")
    assert prompt == seed["prompt"][0]
    # the same Jinja2 rendering as AIPerf's template endpoint (autoescape on)
    text = 'def f(x):\n    return "<a & b>"'
    rendered = jinja2.Environment(autoescape=True).from_string(bench.template(fields))
    body = json.loads(rendered.render(text=text))
    assert body["text_input"] == text
    dtypes = {t.name: t.dtype for t in LLM_INPUTS}
    assert set(body) <= set(dtypes)
    assert body["stream"] is True and body["exclude_input_in_output"] is True
    assert body["max_tokens"] == seed["request_output_len"][0] == 32
    assert body["top_p"] == seed["runtime_top_p"][0]
    assert body["top_k"] == seed["runtime_top_k"][0]
    assert body["seed"] == seed["random_seed"][0]
    assert body["temperature"] == seed["temperature"][0]


def test_the_committed_results_are_aiperfs_numbers():
    bench = _script()
    with (RESULTS / "results.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert {(r["workload"], r["concurrency"]) for r in rows} >= {("test", "1"), ("mixed", "1")}
    for committed in rows:
        directory = RESULTS / "aiperf" / f"{committed['workload']}-c{committed['concurrency']}"
        assert sorted(p.name for p in directory.iterdir()) == sorted(bench.KEEP)
        export = json.loads((directory / "profile_export_aiperf.json").read_text())
        row = bench.row(committed["workload"], int(committed["concurrency"]), export)
        for column in bench.COLUMNS:
            assert str(row[column]) == committed[column], column
        assert int(committed["errors"]) == 0
        assert float(committed["output_tokens_mean"]) == 32.0
