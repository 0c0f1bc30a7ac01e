"""The CI subset of the regression recipes, and proof that a broken replica sync is caught.

The full set (conf/experiment/regression/) runs with `make regression`
(tests/regression/regress.py); here one sequence-parallel run
(``experiment=regression/llama_tp2_sp``) is checked against its golden curve and its tp=1 twin, and
the same run with the fault-injection switch ``debug.fault=replica_sync_sum`` (mean replaced by sum)
must leave its golden band.
"""

from tests.regression import regress


def test_sequence_parallel_llama_matches_golden_and_tp1(tmp_path, capsys):
    assert regress.main(["llama_tp2_sp", "--output-root", str(tmp_path), "--no-plots"]) == 0
    table = capsys.readouterr().out
    assert (
        "llama_tp2_sp         parity   yes" in table
        and "llama_tp2_sp         drift    yes" in table
    )


def test_mean_replaced_by_sum_is_caught(tmp_path, capsys):
    arguments = ["llama_tp2_sp", "--golden-only", "--no-plots", "--output-root", str(tmp_path)]
    assert regress.main([*arguments, "--override", "debug.fault=replica_sync_sum"]) == 1
    assert "llama_tp2_sp         golden   NO" in capsys.readouterr().out
