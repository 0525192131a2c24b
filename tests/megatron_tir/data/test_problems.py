"""verl-schema parquet loading and its errors."""

import logging

import pandas as pd
import pytest

from megatron_tir.data import NAMED_DATASETS, load_problems, resolve_dataset


def test_named_datasets_load():
    ps = load_problems("aime24")
    assert len(ps) == 30
    assert ps[0].ground_truth == "204"
    assert ps[0].messages[-1]["role"] == "user" and "Aya" in ps[0].messages[-1]["content"]
    assert len(load_problems("math500", limit=7)) == 7
    assert load_problems("aime25", limit=1)[0].ground_truth == "70"


def test_math_train_skips_rows_without_ground_truth():
    # A handler on the module's own logger: independent of what other tests did to the root's.
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("megatron_tir.data.problems")
    log.addHandler(handler)
    try:
        ps = load_problems("math_train")
    finally:
        log.removeHandler(handler)
    assert len(ps) == 8523 - 2
    assert all(p.ground_truth.strip() for p in ps)
    assert any("skipped 2 row(s)" in r.getMessage() for r in records)


def test_env_overrides_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_TIR_DATA", str(tmp_path))
    with pytest.raises(ValueError, match="aime24.*not found.*MEGATRON_TIR_DATA"):
        resolve_dataset("aime24")


def _write(tmp_path, **cols):
    path = tmp_path / "d.parquet"
    pd.DataFrame(cols).to_parquet(path)
    return path


def test_file_path_dataset(tmp_path):
    path = _write(tmp_path, prompt=[[{"role": "user", "content": "1+1?"}]],
                  reward_model=[{"ground_truth": "2", "style": "rule"}])
    (p,) = load_problems(path)
    assert p.ground_truth == "2" and p.messages == ({"role": "user", "content": "1+1?"},)


def test_unknown_name_or_missing_file():
    with pytest.raises(ValueError, match="neither a known name.*aime24"):
        load_problems("aime2024")


def test_not_parquet(tmp_path):
    bad = tmp_path / "x.parquet"
    bad.write_text("hello")
    with pytest.raises(ValueError, match="not a readable parquet file"):
        load_problems(bad)


def test_missing_column(tmp_path):
    path = _write(tmp_path, prompt=[[{"role": "user", "content": "q"}]], answer=["2"])
    with pytest.raises(ValueError, match=r"missing column\(s\) reward_model"):
        load_problems(path)


def test_missing_ground_truth(tmp_path):
    path = _write(tmp_path, prompt=[[{"role": "user", "content": "q"}]], reward_model=[{"style": "rule"}])
    with pytest.raises(ValueError, match="row 0: reward_model has no ground_truth"):
        load_problems(path)


def test_prompt_not_messages(tmp_path):
    path = _write(tmp_path, prompt=["just a string"], reward_model=[{"ground_truth": "2"}])
    with pytest.raises(ValueError, match="row 0: 'prompt' must be a list"):
        load_problems(path)


def test_prompt_without_user(tmp_path):
    path = _write(tmp_path, prompt=[[{"role": "system", "content": "s"}]], reward_model=[{"ground_truth": "2"}])
    with pytest.raises(ValueError, match="no user message"):
        load_problems(path)


def test_bad_limit():
    with pytest.raises(ValueError, match="limit"):
        load_problems("aime24", limit=0)


def test_names_are_documented():
    assert set(NAMED_DATASETS) == {"aime24", "aime25", "math500", "math_train"}


def test_named_datasets_ship_with_the_package(monkeypatch):
    # A lone clone (no ../shared beside it) and an installed wheel both find them.
    import fnmatch
    from pathlib import Path

    from setuptools.config.setupcfg import read_configuration

    import megatron_tir.data as data_pkg

    monkeypatch.delenv("MEGATRON_TIR_DATA", raising=False)
    package_dir = Path(data_pkg.__file__).parent
    for name, filename in NAMED_DATASETS.items():
        assert resolve_dataset(name) == package_dir / filename
    setup_cfg = Path(__file__).resolve().parents[3] / "setup.cfg"
    patterns = read_configuration(setup_cfg)["options"]["package_data"]["megatron_tir.data"]
    assert all(any(fnmatch.fnmatch(f, p) for p in patterns) for f in NAMED_DATASETS.values())
