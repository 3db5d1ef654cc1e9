"""The embedded judge's benchmarks run and say what BENCHMARKS.md quotes: the int8 and layout
comparisons (`annotation_throughput.py --compare-dtype / --compare-layout`), the judge-share
runs (`judge_share.py`) and where the judge's time goes (`judge_ceiling.py`)."""
import pytest
from helpers import BENCH, bench_json, script_exit

from torchrl_oni.serve.models import TEST_MODEL, is_installed


@pytest.mark.slow
@pytest.mark.skipif(not is_installed(TEST_MODEL), reason="the SmolLM2 weights are not installed")
def test_int8_comparison_reports_speed_and_agreement():
    pytest.importorskip("ctranslate2")
    result, table = bench_json([BENCH / "annotation_throughput.py", "--model", TEST_MODEL, "--compare-dtype", "int8",
                                "--seconds", "1", "--rounds", "1", "--real-captions", "20", "--threads", "1"],
                               timeout=600)
    assert "speedup (medians)" in table
    assert result["reference_engine"] == "TransformersEngine" and result["candidate_engine"] == "CTranslate2Engine"
    assert result["candidate_dtype"] == "int8"
    assert result["speedup_vs_reference"] > 0 and 0 <= result["agreement_vs_reference"] <= 1
    assert result["n_hand_labelled"] == 40 and result["n_judge_probe"] == 13 and result["n_real_captions"] == 20
    assert len(result["reference_captions_per_s"]) == len(result["candidate_captions_per_s"]) == 1


@pytest.mark.slow
@pytest.mark.skipif(not is_installed(TEST_MODEL), reason="the SmolLM2 weights are not installed")
def test_layout_comparison_reports_speed_agreement_and_the_rounding_floor():
    # float32: the token tree and padded batches compute the same numbers, so every label agrees
    result, table = bench_json([BENCH / "annotation_throughput.py", "--model", TEST_MODEL, "--dtype", "float32",
                                "--layout", "padded", "--compare-layout", "tree", "--throughput-captions",
                                "real_captions", "--max-tokens", "2", "--seconds", "1", "--rounds", "1",
                                "--real-captions", "40", "--threads", "1"], timeout=600)
    assert "the reference against itself" in table
    assert (result["reference_layout"], result["candidate_layout"]) == ("padded", "tree")
    assert result["reference_dtype"] == result["candidate_dtype"] == "float32"
    assert result["max_tokens"] == 2 and result["throughput_captions"] == "real_captions"
    assert result["agreement_vs_reference"] == result["agreement_real_captions"] == 1.0
    assert result["reference_self_agreement"] == 1.0 and result["n_real_captions"] == 40
    assert result["speedup_vs_reference"] > 0


@pytest.mark.parametrize("args, names", [(["--max-tokens", "0"], "--max-tokens"),
                                         (["--throughput-captions", "real_captions", "--real-captions", "0"],
                                          "--real-captions"),
                                         (["--compare-layout", "tree", "--compare-max-tokens", "1"],
                                          "--compare-max-tokens"),
                                         (["--throughput-captions", "stream", "--compare-max-tokens", "0"],
                                          "--compare-max-tokens")])
def test_a_bad_comparison_is_one_line_and_exit_2(capfd, args, names):
    code, err = script_exit(BENCH / "annotation_throughput.py", args, capfd)
    assert code == 2 and err.strip().count("\n") == 0 and names in err


@pytest.mark.slow
def test_judge_share_compares_configurations_beside_a_hog(tmp_path):
    # the scripted annotator stands in for the embedded judge: the run, the hog and the table are what is
    # tested, on runs of a few updates (the hog spins a core for as long as they take)
    result, table = bench_json([BENCH / "judge_share.py", "--frames", "1k", "--hog-procs", "1", "--logs", tmp_path,
                                "--configs", "base=--annotator scripted --workers 1 --envs-per-worker 4",
                                "two=--annotator scripted --workers 1 --envs-per-worker 8"], timeout=600)
    assert "frames/s" in table and "vs base" in table
    assert set(result["results"]) == {"base", "two"} and result["results"]["base"]["fps_vs_baseline"] == 1.0
    for row in result["results"].values():
        assert row["fps"] > 0 and 0 < row["steps_labelled"] <= 1 and row["captions_seen"] > 0
    assert (tmp_path / "base_0.log").is_file()


def test_judge_share_refuses_bad_configurations(capfd):
    code, err = script_exit(BENCH / "judge_share.py", ["--configs", "no-equals-sign"], capfd)
    assert code == 2 and "NAME=FLAGS" in err and len(err.strip().splitlines()) == 1
    code, err = script_exit(BENCH / "judge_share.py", ["--baseline-code", "/nonexistent"], capfd)
    assert code == 2 and "no torchrl_oni package" in err


@pytest.mark.slow
@pytest.mark.skipif(not is_installed(TEST_MODEL), reason="the SmolLM2 weights are not installed")
def test_judge_ceiling_times_the_judges_linear_layers_against_them_alone():
    result, table = bench_json([BENCH / "judge_ceiling.py", "--model", TEST_MODEL, "--dtype", "float32",
                                "--seconds", "2", "--rounds", "2", "--alone-seconds", "0.2",
                                "--int8-agreement", "10"], timeout=600)
    assert "ceiling same dtype" in table and "int8 MLP layers" in table
    assert result["model"] == TEST_MODEL and result["dtype"] == "float32" and result["threads"] == 1
    assert len(result["captions_per_s"]) == 2 and min(result["captions_per_s"]) > 0
    # a small model spends most of a request in its linear layers, but not all of it (the
    # attention, the tree's bookkeeping); the vocabulary projection is one of them
    assert 0.3 < result["linear_share"] < 1 and 0 < result["vocab_share"] < result["linear_share"]
    assert result["linear_gflops_in_judge"] > 0 and result["linear_gflops_alone"] > 0
    assert result["linear_efficiency"] > 0 and result["ceiling_same_dtype"] > 0
    assert result["tokens_per_caption"] > 1
    if result["int8_unavailable"] is None:
        assert result["ceiling_int8"] > 0 and result["int8_rate_vs_same_dtype"] > 0
        agreement = result["int8_mlp_agreement"]
        assert agreement["layers_in_int8"] == 3 * 30  # gate, up and down of SmolLM2-135M's 30 layers
        assert (agreement["n_hand_labelled"], agreement["n_judge_probe"], agreement["n_real_captions"]) == (40, 13, 10)
        assert 0 <= agreement["agreement"] <= 1


@pytest.mark.parametrize("args, names", [(["--seconds", "0"], "--seconds"), (["--rounds", "0"], "--rounds"),
                                         (["--batch", "0"], "--batch"), (["--int8-agreement", "-1"], "--int8-agreement"),
                                         (["--alone-seconds", "-1"], "--alone-seconds")])
def test_judge_ceiling_refuses_bad_input_in_one_line(capfd, args, names):
    code, err = script_exit(BENCH / "judge_ceiling.py", args, capfd)
    assert code == 2 and err.strip().count("\n") == 0 and names in err


def test_judge_ceiling_names_a_model_it_cannot_load(capfd):
    code, err = script_exit(BENCH / "judge_ceiling.py", ["--model", "/nonexistent/judge"], capfd)
    assert code == 2 and err.strip().count("\n") == 0 and "/nonexistent/judge" in err
