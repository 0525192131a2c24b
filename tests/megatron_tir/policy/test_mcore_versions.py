"""The megatron-core API the project uses exists, with the same parameters, in the installed release and in
the newest one the clusters run (0.19.2, read from its wheel: tests/megatron_tir/policy/mcore_api.py)."""

from __future__ import annotations

import json

import pytest
from mcore_api import EXTRA, HERE, installed_sources, project_uses, signatures

NEWEST = json.loads((HERE / "mcore_signatures_0.19.2.json").read_text())


@pytest.fixture(scope="module")
def installed():
    version, sources = installed_sources()
    uses = project_uses(sources)
    return version, uses, signatures(sources, set(uses) | set(EXTRA))


def _params(sig: dict) -> dict[str, list]:
    sig = sig.get("forwards_to", sig)
    return {p[0]: p for p in sig["params"]}


def _accepts(sig: dict, keyword: str) -> bool:
    inner = sig.get("forwards_to", sig)
    return keyword in _params(sig) or inner["varkw"]


def test_every_name_the_project_uses_exists_in_both_releases(installed):
    version, uses, old = installed
    new = NEWEST["signatures"]
    assert len(uses) > 30  # the scan finds the project's imports (an empty scan would pass anything)
    missing_new = sorted(t for t in uses if t not in new)
    missing_old = sorted(t for t in uses if t not in old)
    assert not missing_new, f"not in megatron-core {NEWEST['version']} (or rerun mcore_api.py): {missing_new}"
    assert not missing_old, f"not in the installed megatron-core {version}: {missing_old}"
    assert all(old[t]["kind"] == new[t]["kind"] for t in uses)


def test_every_keyword_the_project_passes_is_accepted_by_both(installed):
    _, uses, old = installed
    new = NEWEST["signatures"]
    bad = [(t, k, rel) for t, kws in uses.items() for k in sorted(kws)
           for rel, sig in (("installed", old[t]), (NEWEST["version"], new[t])) if sig["kind"] != "module"
           and not _accepts(sig, k)]
    assert not bad


def test_no_new_required_parameter_and_the_known_differences(installed):
    """A parameter required in 0.19.2 that the installed release lacks would break a call; the
    differences DESIGN.md names are there, all optional (the project's calls work with both)."""
    _, uses, old = installed
    new = NEWEST["signatures"]
    for t in set(uses) | set(EXTRA):
        if new[t]["kind"] == "module":
            continue
        before = _params(old[t])
        added_required = [n for n, p in _params(new[t]).items() if not p[2] and n not in before]
        assert not added_required, (t, added_required)
    added = lambda t: set(_params(new[t])) - set(_params(old[t]))  # noqa: E731
    assert "schedule_pg_collection" in added("megatron.core.pipeline_parallel.get_forward_backward_func")
    assert "tp_group" in added("megatron.core.tensor_parallel.vocab_parallel_cross_entropy")
    assert len(added("megatron.core.parallel_state.initialize_model_parallel")) >= 2
    for spec_fn in ("get_gpt_layer_local_spec", "get_gpt_layer_with_transformer_engine_spec"):
        sig = new[f"megatron.core.models.gpt.gpt_layer_specs.{spec_fn}"]
        assert sig["varargs"] and sig["varkw"] and not sig["params"]  # now (*args, **kwargs)
    assert "normalization" in _params(new["megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_local_spec"])
    for unchanged in ("megatron.core.optimizer.get_megatron_optimizer",
                      "megatron.core.optimizer_param_scheduler.OptimizerParamScheduler"):
        assert new[unchanged]["params"] == old[unchanged]["params"]


def test_transformer_config_and_schedule_keywords_exist_in_both(installed):
    """What reaches TransformerConfig through dicts (the spec's kwargs, the learner's overrides and memory
    settings) and the keywords the learner passes to the schedule get_forward_backward_func returns."""
    from megatron_tir.model_sources import resolve_model
    from megatron_tir.policy.learner_config import LearnerConfig
    from megatron_tir.policy.spec import spec_from_hf_dir

    _, _, old = installed
    new = NEWEST["signatures"]
    spec, _ = spec_from_hf_dir(resolve_model("tiny-qwen2"))
    cfg = LearnerConfig(tp=2, sequence_parallel=True, recompute_granularity="full", recompute_method="uniform",
                        recompute_num_layers=1, fp8="hybrid")
    keys = set(spec.transformer_config(tp=2, pp=1, **cfg.transformer_overrides(), variable_seq_lengths=True,
                                       moe_token_dispatcher_type="alltoall").__dict__) & (
        {"variable_seq_lengths", "moe_token_dispatcher_type", "perform_initialization"}
        | set(cfg.transformer_overrides()) | {"num_layers", "hidden_size", "ffn_hidden_size", "num_query_groups",
                                              "kv_channels", "add_qkv_bias", "use_cpu_initialization"})
    tc = "megatron.core.transformer.transformer_config.TransformerConfig"
    assert len(keys) > 12
    for rel, sigs in (("installed", old), (NEWEST["version"], new)):
        assert not [k for k in keys if not _accepts(sigs[tc], k)], rel
    schedule_kws = {"forward_step_func", "data_iterator", "model", "num_microbatches", "seq_length",
                    "micro_batch_size", "forward_only"}
    for fn in EXTRA[2:]:
        for rel, sigs in (("installed", old), (NEWEST["version"], new)):
            assert schedule_kws <= set(_params(sigs[fn])), (fn, rel)
