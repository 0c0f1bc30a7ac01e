"""Trackers through their own libraries, read back with their own readers: TensorBoard's event
reader, the W&B offline run file, MLflow's client on its local store. Missing packages are one error
line."""

import inspect
import json
import struct
import sys
from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from components.training import loggers
from components.training.distillation import DISTILL_METRICS
from components.training.loggers import (
    LoggerUnavailableError,
    MlflowLogger,
    NoLogger,
    TensorBoardLogger,
    WandbLogger,
    check_logger_available,
    check_logger_options,
    flatten_config,
    metric_values,
)
from components.training.preference import DPO_METRICS

REPO = Path(__file__).resolve().parents[3]
CONFIG = {"tp": 2, "optim": {"lr": 0.001, "betas": [0.9, 0.95]}, "checkpoint": {"resume": None}}


def record(step: int) -> dict:
    """A metrics.jsonl line: validation on even steps, a None and a boolean to be left out."""
    line = {
        "step": step,
        "loss": 5.0 - step / 4,
        "grad_norm": 1.5,
        "lr": 1e-3 * step,
        "tokens_per_s": 900.0,
        "tokens": 384,
        "peak_memory_gib": None,
        "skipped": False,
    }
    if step % 2 == 0:
        line["val_loss"] = 4.0 - step / 8
    return line


def log_run(logger, steps=range(1, 5)) -> None:
    logger.log_hparams(CONFIG)
    for step in steps:
        logger.log_metrics(record(step), step)
    logger.close()


def test_metric_values_and_flat_config():
    assert metric_values(record(2)) == {
        "loss": 4.5,
        "grad_norm": 1.5,
        "lr": 2e-3,
        "tokens_per_s": 900.0,
        "tokens": 384.0,
        "val_loss": 3.75,
    }
    assert flatten_config(CONFIG) == {
        "tp": 2,
        "optim.lr": 0.001,
        "optim.betas": "[0.9, 0.95]",
        "checkpoint.resume": None,
    }


def test_every_logger_yaml_names_its_class_and_options(tmp_path):
    classes = {
        "none": NoLogger,
        "tensorboard": TensorBoardLogger,
        "wandb": WandbLogger,
        "mlflow": MlflowLogger,
    }
    for option, cls in classes.items():
        node = OmegaConf.load(REPO / "conf" / "logger" / f"{option}.yaml")
        assert node["_target_"] == f"components.training.loggers.{cls.__name__}"
        assert check_logger_available(node["_target_"]) is None, option
        parameters = set(inspect.signature(cls).parameters) - {"output_dir", "first_step"}
        assert set(node) - {"_target_"} == parameters, option
    logger = instantiate(
        OmegaConf.load(REPO / "conf" / "logger" / "none.yaml"),
        output_dir=str(tmp_path),
        first_step=0,
    )
    assert isinstance(logger, NoLogger)
    log_run(logger)
    log_run(
        instantiate(
            OmegaConf.load(REPO / "conf" / "logger" / "tensorboard.yaml"), output_dir=str(tmp_path)
        )
    )
    assert [path.name for path in tmp_path.iterdir()] == ["tensorboard"]


def test_a_missing_package_is_one_error_line(monkeypatch, tmp_path):
    monkeypatch.setitem(
        sys.modules, "wandb", None
    )  # as if not installed: import raises ImportError
    assert check_logger_available("components.training.loggers.WandbLogger") == (
        "logger=wandb needs the wandb package: pip install 'shardtune[loggers]'"
    )
    with pytest.raises(
        LoggerUnavailableError, match=r"^logger=wandb needs the wandb package: pip install"
    ):
        WandbLogger(tmp_path)
    assert (
        check_logger_available("my_trackers.Logger")
        == "logger._target_='my_trackers.Logger': module 'my_trackers' is not installed"
    )


def test_tensorboard_holds_a_loss_scalar_per_step_and_a_resume_replaces_the_tail(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_run(TensorBoardLogger(tmp_path))
    log_run(
        TensorBoardLogger(tmp_path, first_step=2), steps=range(3, 6)
    )  # resumed at step 2: 3 and 4 again
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    loss = [(event.step, event.value) for event in events.Scalars("loss")]
    assert loss == [(step, 5.0 - step / 4) for step in range(1, 6)]
    assert [(event.step, event.value) for event in events.Scalars("val_loss")] == [
        (2, 3.75),
        (4, 3.5),
    ]
    assert {"grad_norm", "lr", "tokens_per_s", "tokens"} <= set(events.Tags()["scalars"])
    assert (
        "peak_memory_gib" not in events.Tags()["scalars"]
        and "skipped" not in events.Tags()["scalars"]
    )
    assert "config/text_summary" in events.Tags()["tensors"]


def wandb_records(path: Path) -> list:
    """The protobuf records of a W&B run file (its LevelDB-style log: 7-byte header, 32 KiB blocks,
    chunks)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, chunks, records = 7, [], []
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        if left < 7:
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        position += 7
        if kind == 0:  # zero padding to the end of the block
            position += left - 7
            continue
        chunks.append(data[position : position + length])
        position += length
        if kind in (1, 4):  # a full record, or the last chunk of one
            records.append(wandb_internal_pb2.Record.FromString(b"".join(chunks)))
            chunks = []
    return records


def key_of(item) -> str:
    return item.key or "/".join(item.nested_key)


def test_wandb_offline_run_file_holds_the_metrics_and_config(tmp_path, monkeypatch):
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    quick = {
        "x_disable_stats": True,
        "x_disable_meta": True,
        "x_disable_machine_info": True,
        "console": "off",
    }
    log_run(WandbLogger(tmp_path / "run", name="run-a", settings=quick))
    (run_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    records = wandb_records(run_file)
    history = [
        {key_of(item): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [(row["_step"], row["loss"]) for row in history] == [
        (step, 5.0 - step / 4) for step in range(1, 5)
    ]
    assert [row.get("val_loss") for row in history] == [None, 3.75, None, 3.5]
    assert all("peak_memory_gib" not in row and "skipped" not in row for row in history)
    config = {}
    for r in records:
        if r.WhichOneof("record_type") in ("run", "config"):
            updates = (
                r.run.config.update if r.WhichOneof("record_type") == "run" else r.config.update
            )
            config.update({key_of(item): json.loads(item.value_json) for item in updates})
    assert config["optim"] == {"lr": 0.001, "betas": [0.9, 0.95]} and config["tp"] == 2
    assert (
        next(r.run.display_name for r in records if r.WhichOneof("record_type") == "run") == "run-a"
    )


def test_mlflow_local_store_holds_the_metrics_and_params(tmp_path):
    from mlflow.tracking import MlflowClient

    logger = MlflowLogger(tmp_path, experiment="exp")
    log_run(logger)
    assert logger.tracking_uri == (tmp_path / "mlruns").resolve().as_uri()
    client = MlflowClient(tracking_uri=logger.tracking_uri)
    loss = [
        (metric.step, metric.value) for metric in client.get_metric_history(logger.run_id, "loss")
    ]
    assert loss == [(step, 5.0 - step / 4) for step in range(1, 5)]
    assert [(m.step, m.value) for m in client.get_metric_history(logger.run_id, "val_loss")] == [
        (2, 3.75),
        (4, 3.5),
    ]
    run = client.get_run(logger.run_id)
    assert run.data.params == {
        "tp": "2",
        "optim.lr": "0.001",
        "optim.betas": "[0.9, 0.95]",
        "checkpoint.resume": "None",
    }
    assert run.info.status == "FINISHED" and run.info.run_name == tmp_path.name
    assert "peak_memory_gib" not in run.data.metrics


def test_the_trackers_get_a_mixtures_validation_loss_per_source():
    record = {"loss": 2.0, "val_loss": 1.9, "val_loss/chat": 1.8, "val_loss/general": 2.1}
    assert metric_values(record) == record


def test_the_trackers_get_every_metric_of_dpo_and_distillation_and_their_validation():
    """dpo.py's TRL names (the step's and ``val_``'s) and distill.py's cross entropy and KL reach
    the trackers as metrics.jsonl has them (they once reached metrics.jsonl alone)."""
    dpo = {name: 0.5 for name in DPO_METRICS} | {f"val_{name}": 0.25 for name in DPO_METRICS}
    assert metric_values(dpo) == dpo
    distill = {name: 1.5 for name in DISTILL_METRICS} | {"val_loss": 1.25}
    assert metric_values(distill) == distill


def test_the_trackers_get_the_expert_load_keys():
    record = {"loss": 2.0, "expert_imbalance": 1.5, "expert_imbalance/layer_0": 1.5}
    record |= {"expert_load/layer_0/expert_0": 0.25, "expert_loads": "not a metric"}
    assert metric_values(record) == {
        "loss": 2.0,
        "expert_imbalance": 1.5,
        "expert_imbalance/layer_0": 1.5,
        "expert_load/layer_0/expert_0": 0.25,
    }


def test_logger_options_that_work_pass_the_checks(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password k3y\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    target = "components.training.loggers."
    assert check_logger_options(target + "WandbLogger", {"mode": "online"}, tmp_path) == []
    assert check_logger_options(target + "WandbLogger", {"mode": "disabled"}, tmp_path) == []
    assert check_logger_options(target + "TensorBoardLogger", {"log_dir": None}, tmp_path) == []
    for uri in (None, (tmp_path / "mlruns").as_uri(), "sqlite:///mlflow.db"):
        assert check_logger_options(target + "MlflowLogger", {"tracking_uri": uri}, tmp_path) == []
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    assert check_logger_options(target + "WandbLogger", {"mode": "online"}, tmp_path)
    monkeypatch.setenv("WANDB_API_KEY", "k3y")
    assert check_logger_options(target + "WandbLogger", {"mode": "online"}, tmp_path) == []


def test_a_tensorboard_folder_under_a_file_is_refused(tmp_path):
    (tmp_path / "tensorboard").write_text("a file")
    target = "components.training.loggers.TensorBoardLogger"
    (line,) = check_logger_options(target, {"log_dir": None}, tmp_path)
    assert "is a file" in line
    assert check_logger_options(target, {"log_dir": str(tmp_path / "tensorboard" / "x")}, tmp_path)


def test_a_resumed_mlflow_run_whose_run_was_deleted_logs_to_a_new_one(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    first = MlflowLogger(tmp_path)
    log_run(first, steps=range(1, 4))
    MlflowClient(tracking_uri=first.tracking_uri).delete_run(first.run_id)
    resumed = MlflowLogger(tmp_path, first_step=2)
    log_run(resumed, steps=range(3, 5))
    assert resumed.run_id != first.run_id
    recorded = json.loads((tmp_path / "tracker_runs.json").read_text())["mlflow"]
    assert recorded["run_id"] == resumed.run_id
    client = MlflowClient(tracking_uri=resumed.tracking_uri)
    assert [m.step for m in client.get_metric_history(resumed.run_id, "loss")] == [3, 4]
    said = capsys.readouterr().err
    assert f"the MLflow run {first.run_id} this folder logged to is deleted" in said
    assert f"steps from 3 go to a new run, {resumed.run_id}" in said


def test_a_resumed_wandb_run_is_rewound_over_its_last_steps_and_given_them_again(
    tmp_path, monkeypatch, capsys
):
    """Rewound :data:`REWOUND_STEPS` (here 2) before the resumed step 4, so steps 3-4 come again
    from metrics.jsonl (a cut last line skipped); a fresh run into the folder starts a new run."""
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home"))
    monkeypatch.setattr(loggers, "REWOUND_STEPS", 2)
    quick = {"x_disable_stats": True, "x_disable_meta": True, "console": "off", "silent": True}
    first = WandbLogger(tmp_path, settings=quick)
    log_run(first, steps=range(1, 6))
    lines = [json.dumps(record(step)) for step in range(1, 5)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 5, "lo')
    resumed = WandbLogger(tmp_path, first_step=4, settings=quick)
    log_run(resumed, steps=range(5, 7))
    assert resumed.run.id == first.run.id
    folder = sorted((tmp_path / "wandb").glob("offline-run-*"))[1]
    records = wandb_records(next(folder.glob("run-*.wandb")))
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.branch_point.run, run.branch_point.value) == (first.run.id, 2.0)
    rows = [r.history.item for r in records if r.WhichOneof("record_type") == "history"]
    steps = [json.loads(i.value_json) for row in rows for i in row if key_of(i) == "_step"]
    assert steps == [3, 4, 5, 6]
    assert "then steps 3-4 logged again from metrics.jsonl" in capsys.readouterr().err
    fresh = WandbLogger(tmp_path, settings=quick)
    fresh.close()
    assert fresh.run.id != first.run.id


def test_a_wandb_server_that_refuses_the_rewind_gets_the_run_resumed_without_one(
    tmp_path, monkeypatch, capsys
):
    """As a server without W&B's rewind preview answers ``resume_from``: an error from
    ``wandb.init``. The run is resumed by id instead, and the note says what W&B then keeps."""
    import wandb

    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home"))
    quick = {"x_disable_stats": True, "x_disable_meta": True, "console": "off", "silent": True}
    first = WandbLogger(tmp_path, settings=quick)
    log_run(first, steps=range(1, 3))
    init = wandb.init

    def refusing(**options):
        if "resume_from" in options:
            raise wandb.errors.CommError("failed to rewind run: not enabled for this entity")
        return init(**options)

    monkeypatch.setattr(wandb, "init", refusing)
    resumed = WandbLogger(tmp_path, first_step=2, settings=quick)
    log_run(resumed, steps=range(3, 5))
    assert resumed.run.id == first.run.id
    said = capsys.readouterr().err
    assert f"continuing W&B run {first.run.id} after step 2; W&B refused to rewind it" in said
    assert "(failed to rewind run: not enabled for this entity)" in said
