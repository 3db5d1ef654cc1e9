"""The embedded judge's benchmarks run and say what BENCHMARKS.md quotes: the int8 and layout
comparisons (`annotation_throughput.py --compare-dtype / --compare-layout`) and the judge-share
runs (`judge_share.py`)."""
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
