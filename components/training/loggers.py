"""Experiment trackers for the metrics line: none, TensorBoard, Weights & Biases (offline by
default), MLflow (a local store by default). Chosen with ``logger=<name>`` (``conf/logger/*.yaml``,
each a ``_target_`` here).

Every logger takes the run's ``output_dir`` and ``first_step`` (the step a resumed run starts after)
plus its own yaml options, and offers :class:`MetricsLogger`: ``log_hparams`` (the composed config,
once), ``log_metrics`` (one metrics record per optimizer step) and ``close``. Build one on the rank
that writes ``metrics.jsonl`` only; the other ranks need none (or :class:`NoLogger`). A resumed
run continues the tracker run the folder began (docs/checkpoints.md, "Trackers at a resume").

A tracker's package is imported when its logger is built; a missing one raises
:class:`LoggerUnavailableError` whose message is the one ``error:`` line to show. The pre-launch
checks ask :func:`check_logger_available` first, which imports nothing, then
:func:`check_logger_options` (a ``log_dir`` that is a file, a wandb ``mode``, its key, an MLflow
server that does not answer within 3 s), so that no rank finds them.
"""

import importlib.util
import json
import netrc
import os
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from components.targets import target_class
from components.training.tracker_runs import continued_run, record_run, records_between

# Fields of a metrics record sent to a tracker, when present and not None.
_THROUGHPUT = ("tokens_per_s", "tokens", "tflops", "mfu")  # mfu: on CUDA only
METRIC_KEYS = (
    *("loss", "grad_norm", "lr", *_THROUGHPUT, "peak_memory_gib", "val_loss"),
    "expert_imbalance",  # MoE models: the worst layer's tokens per expert, max / mean
    "ce_loss",  # distill.py's (components/training/distillation.py DISTILL_METRICS)
    "kd_loss",
)
# ... and every key under these (MoE: expert_imbalance/layer_N, expert_load/layer_N/expert_E; a
# mixture of sources: val_loss/<source>; dpo.py's TRL names, components/training/preference.py
# DPO_METRICS, and their validation's).
METRIC_PREFIXES = ("expert_imbalance/", "expert_load/", "val_loss/")
METRIC_PREFIXES += ("rewards/", "logps/", "val_rewards/", "val_logps/")
_EXTRA = "pip install 'shardtune[loggers]'"
# Logger class name -> (config group option, module it needs, what to install).
_NEEDS = {
    "TensorBoardLogger": ("tensorboard", "tensorboard", "pip install tensorboard"),
    "WandbLogger": ("wandb", "wandb", _EXTRA),
    "MlflowLogger": ("mlflow", "mlflow", _EXTRA),
}


class LoggerUnavailableError(ImportError):
    """A tracker's package is not installed; the message is one line naming what to install."""


class MetricsLogger(Protocol):
    """What the training loop calls on a tracker."""

    def log_hparams(self, config: dict) -> None:
        """Record the run's composed config (nested mapping) as its hyper-parameters."""

    def log_metrics(self, record: dict, step: int) -> None:
        """Record one metrics line (see :data:`METRIC_KEYS`) at optimizer step ``step``."""

    def close(self) -> None:
        """Flush and finish the run."""


def check_logger_available(target: str) -> str | None:
    """The error line for a logger ``_target_`` whose package is missing, or None; imports nothing
    heavy."""
    name = target.rsplit(".", 1)[-1]
    if name in _NEEDS:
        option, module, install = _NEEDS[name]
        return (
            None if _installed(module) else f"logger={option} needs the {module} package: {install}"
        )
    module = target.rsplit(".", 1)[0]
    return (
        None
        if _installed(module)
        else f"logger._target_={target!r}: module {module!r} is not installed"
    )


WANDB_MODES = ("online", "offline", "disabled")
# The MLflow tag that records each resume of a run, as FIRST_STEP@MILLISECONDS (the time it began),
# space-separated, the last _RESUMES_KEPT of them: a metric value logged at a step after
# FIRST_STEP before that time is the stopped attempt's.
RESUMES_TAG = "shardtune.resumes"
# How many steps before a resume's checkpoint a W&B run is rewound over and given again from
# metrics.jsonl: W&B writes its offline file (and uploads) in batches, so a killed attempt's last
# steps, about 100 in offline mode (one 32 KiB block), may never have reached it.
REWOUND_STEPS = 1000
_RESUMES_KEPT = 200
REACH_SECONDS = 3.0  # how long the checks wait for an MLflow server to accept a connection


def check_logger_options(target: str, options: Mapping[str, Any], output_dir: Path) -> list[str]:
    """The error lines for a tracker's options that its rank would only find when built: a
    TensorBoard ``log_dir`` that is (or lies under) a file, a wandb ``mode`` it does not take or
    ``mode=online`` without a key, an http(s) MLflow ``tracking_uri`` that does not answer."""
    name = target.rsplit(".", 1)[-1]
    if name == "TensorBoardLogger":
        log_dir = options.get("log_dir")
        return _folder_errors("logger.log_dir", Path(log_dir or Path(output_dir) / "tensorboard"))
    if name == "WandbLogger":
        return _wandb_errors(str(options.get("mode", "offline")))
    if name == "MlflowLogger" and options.get("tracking_uri"):
        return _reach_errors(str(options["tracking_uri"]))
    return []


def _folder_errors(key: str, folder: Path) -> list[str]:
    """A folder to be created: refused where it, or a folder above it, is a file."""
    for path in (folder, *folder.parents):
        if path.exists():
            if path.is_dir():
                return []
            return [f"{key}={str(folder)!r} cannot be a folder: {path} is a file; use another path"]
    return []


def _wandb_errors(mode: str) -> list[str]:
    if mode not in WANDB_MODES:
        return [f"logger.mode={mode!r} is not valid: use one of {', '.join(WANDB_MODES)}"]
    if mode == "online" and not _wandb_key():
        return [
            "logger.mode=online needs a W&B API key: set WANDB_API_KEY (or run `wandb login`), "
            "or use logger.mode=offline (upload later with `wandb sync`)"
        ]
    return []


def _wandb_key() -> bool:
    """A key in ``WANDB_API_KEY`` or the netrc entry ``wandb login`` writes for the server."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        found = netrc.netrc(os.environ.get("NETRC") or None).authenticators(host or "")
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(found and found[2])


def _reach_errors(uri: str) -> list[str]:
    """An http(s) server must accept a connection within :data:`REACH_SECONDS`; a local path,
    ``file:``, ``sqlite:`` and other stores are left to MLflow."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        return []
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname or "", port), timeout=REACH_SECONDS).close()
    except OSError as error:
        cause = "no answer" if isinstance(error, TimeoutError) else error.strerror or str(error)
        return [
            f"logger.tracking_uri={uri!r} cannot be reached ({parts.hostname}:{port}: {cause}; "
            f"the checks wait {REACH_SECONDS:g} s): start the server, or use "
            "logger.tracking_uri=null (a local store in <output_dir>/mlruns)"
        ]
    return []


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (
        ModuleNotFoundError,
        ValueError,
    ):  # a missing parent package; a module blocked in sys.modules
        return False


def metric_values(record: Mapping[str, Any]) -> dict[str, float]:
    """The :data:`METRIC_KEYS` of ``record``, then its keys under :data:`METRIC_PREFIXES`, that
    hold a number (None, booleans and text are left out)."""
    prefixed = [key for key in record if key.startswith(METRIC_PREFIXES)]
    return {
        key: float(record[key])
        for key in (*METRIC_KEYS, *prefixed)
        if isinstance(record.get(key), int | float) and not isinstance(record.get(key), bool)
    }


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 1e-3}}`` -> ``{"optim.lr": 1e-3}``; lists become their JSON text."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_config(value, name + "."))
        else:
            flat[name] = json.dumps(value) if isinstance(value, list | tuple) else value
    return flat


def _unavailable(class_name: str) -> LoggerUnavailableError:
    option, module, install = _NEEDS[class_name]
    return LoggerUnavailableError(f"logger={option} needs the {module} package: {install}")


class NoLogger:
    """Logs nothing (``logger=none``)."""

    def __init__(self, output_dir: str | Path, first_step: int = 0) -> None:
        self.output_dir = Path(output_dir)

    def log_hparams(self, config: dict) -> None:
        """Nothing to record."""

    def log_metrics(self, record: dict, step: int) -> None:
        """Nothing to record."""

    def close(self) -> None:
        """Nothing to close."""


class TensorBoardLogger:
    """Event files in ``<output_dir>/tensorboard`` (or ``log_dir``): one scalar per metric per step,
    the config as text and as hyper-parameters. A resumed run drops the events a killed run wrote
    past ``first_step``. View with ``tensorboard --logdir <output_dir>/tensorboard``."""

    def __init__(
        self,
        output_dir: str | Path,
        first_step: int = 0,
        log_dir: str | None = None,
        flush_secs: int = 30,
    ) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise _unavailable("TensorBoardLogger") from None
        self.log_dir = Path(log_dir) if log_dir else Path(output_dir) / "tensorboard"
        purge = first_step + 1 if first_step > 0 else None
        self.writer = SummaryWriter(
            log_dir=str(self.log_dir), purge_step=purge, flush_secs=flush_secs
        )

    def log_hparams(self, config: dict) -> None:
        """The config as a text summary (readable) and as HParams (comparable across runs)."""
        self.writer.add_text(
            "config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```"
        )
        scalars = {
            key: value if isinstance(value, int | float | str | bool) else str(value)
            for key, value in flatten_config(config).items()
        }
        self.writer.add_hparams(
            scalars, {}, run_name="."
        )  # ".": into this run's folder, not a new one

    def log_metrics(self, record: dict, step: int) -> None:
        """One scalar per metric, named as in metrics.jsonl."""
        for key, value in metric_values(record).items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        """Flush the event file and close it."""
        self.writer.close()


class WandbLogger:
    """A Weights & Biases run under ``<output_dir>/wandb``: ``mode: offline`` (the default) writes
    it there, to upload later with ``wandb sync``; ``mode: online`` sends it to the server the user
    configured (``wandb login``, ``WANDB_BASE_URL``). ``settings``: extra ``wandb.Settings``
    fields. A resumed run continues the W&B run the folder recorded
    (:mod:`components.training.tracker_runs`), rewound to the step after ``first_step`` (W&B's
    ``resume_from``): the steps a stopped attempt logged after it are cut from the history."""

    def __init__(
        self,
        output_dir: str | Path,
        first_step: int = 0,
        project: str = "shardtune",
        name: str | None = None,
        entity: str | None = None,
        mode: str = "offline",
        tags: list[str] | None = None,
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        try:
            import wandb
        except ImportError:
            raise _unavailable("WandbLogger") from None
        self.wandb = wandb  # the module, imported once: close() tears its service down
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        where = {"project": project, "entity": entity}
        options = dict(
            project=project,
            name=name or Path(output_dir).resolve().name,
            entity=entity,
            dir=str(output_dir),
            tags=list(tags or []),
            settings=wandb.Settings(mode=mode, **dict(settings or {})),
        )
        recorded = continued_run(output_dir, "wandb", first_step, where)
        if recorded is None or mode == "disabled":
            self.run = wandb.init(**options)
        else:
            self.run = self._rewound(recorded, first_step, mode, options, Path(output_dir))
        if mode != "disabled":  # a disabled run is nothing to continue
            record_run(output_dir, "wandb", self.run.id, where)

    def _rewound(
        self, run_id: str, first_step: int, mode: str, options: dict, output_dir: Path
    ) -> Any:
        """The recorded run rewound to :data:`REWOUND_STEPS` before ``first_step`` (W&B keeps its
        history up to that step and cuts the rest), then given those steps again from
        ``metrics.jsonl``; where the server refuses a rewind (a preview feature there), the run
        resumed without one."""
        start = max(0, first_step - REWOUND_STEPS)
        refused = None
        try:
            run = self.wandb.init(resume_from=f"{run_id}?_step={start}", **options)
        except self.wandb.Error as error:
            refused = (str(error).strip().splitlines() or [type(error).__name__])[0]
            run = self.wandb.init(id=run_id, resume="allow", **options)
        else:
            for record in records_between(output_dir / "metrics.jsonl", start, first_step):
                run.log(metric_values(record), step=record["step"])
        note = _wandb_resume_note(run_id, first_step, start, mode, refused)
        print(note, file=sys.stderr, flush=True)
        return run

    def log_hparams(self, config: dict) -> None:
        """The config as the run's config (nested, as W&B shows it)."""
        self.run.config.update(config, allow_val_change=True)

    def log_metrics(self, record: dict, step: int) -> None:
        """One history row at ``step``."""
        self.run.log(metric_values(record), step=step)

    def close(self) -> None:
        """Finish the run and wait for W&B's service process to write it out (offline: the run file
        is complete in ``<output_dir>/wandb`` when this returns; ``finish`` alone may return
        before)."""
        self.run.finish()
        self.wandb.teardown()


class MlflowLogger:
    """An MLflow run in ``tracking_uri`` (default ``file:<output_dir>/mlruns``, a local store that
    needs no server; MLflow 3 keeps file stores behind ``MLFLOW_ALLOW_FILE_STORE``, set here for
    that case only). Any other MLflow URI works too: ``http://host:5000``, ``sqlite:///mlflow.db``
    (with sqlalchemy). A resumed run continues the MLflow run the folder recorded
    (:mod:`components.training.tracker_runs`); MLflow cannot remove a logged value, so the steps
    after ``first_step`` that a stopped attempt logged keep those values beside the new ones: a
    ``note:`` says which, and the tag :data:`RESUMES_TAG` when each resume began."""

    def __init__(
        self,
        output_dir: str | Path,
        first_step: int = 0,
        tracking_uri: str | None = None,
        experiment: str = "shardtune",
        run_name: str | None = None,
    ) -> None:
        try:
            from mlflow import entities, exceptions, tracking
        except ImportError:
            raise _unavailable("MlflowLogger") from None
        self.entities = entities  # the module, imported once: each batch's Param and Metric
        self.tracking_uri = tracking_uri or (Path(output_dir).resolve() / "mlruns").as_uri()
        if self.tracking_uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = tracking.MlflowClient(tracking_uri=self.tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        where = {"tracking_uri": self.tracking_uri, "experiment_id": experiment_id}
        recorded = continued_run(output_dir, "mlflow", first_step, where)
        try:  # a recorded run deleted since (or purged from the store) is not continued
            alive = recorded and self.client.get_run(recorded).info.lifecycle_stage == "active"
        except exceptions.MlflowException:
            alive = False
        self.continued = bool(alive)
        if alive:
            self.run_id = recorded
            self._continue(first_step)
        else:
            name = run_name or Path(output_dir).resolve().name
            self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
            record_run(output_dir, "mlflow", self.run_id, where)
            if recorded:
                print(_mlflow_lost_note(recorded, self.run_id, first_step), file=sys.stderr)

    def _continue(self, first_step: int) -> None:
        """Mark the recorded run running again, add this resume to its :data:`RESUMES_TAG` and say
        which steps now hold two values."""
        history = self.client.get_metric_history(self.run_id, "loss")
        logged = max((metric.step for metric in history), default=0)
        self.client.update_run(self.run_id, status="RUNNING")
        tags = self.client.get_run(self.run_id).data.tags
        resume = f"{first_step}@{int(time.time() * 1000)}"
        resumes = f"{tags[RESUMES_TAG]} {resume}" if RESUMES_TAG in tags else resume
        kept = " ".join(resumes.split()[-_RESUMES_KEPT:])  # a tag holds at most 8000 characters
        self.client.set_tag(self.run_id, RESUMES_TAG, kept)
        print(_mlflow_resume_note(self.run_id, first_step, logged), file=sys.stderr, flush=True)

    def log_hparams(self, config: dict) -> None:
        """The flattened config as run parameters (MLflow keeps parameters as text, at most 6000
        characters). A continued run keeps the values it has: MLflow refuses to change one, so a
        setting changed at resume is said in a ``note:`` instead."""
        flat = {key: str(value)[:6000] for key, value in flatten_config(config).items()}
        kept = self.client.get_run(self.run_id).data.params if self.continued else {}
        params = [self.entities.Param(key, value) for key, value in flat.items() if key not in kept]
        changed = {
            key: (kept[key], value) for key, value in flat.items() if kept.get(key, value) != value
        }
        if changed:
            print(_mlflow_params_note(self.run_id, changed), file=sys.stderr, flush=True)
        for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    def log_metrics(self, record: dict, step: int) -> None:
        """One MLflow metric per value, at ``step``."""
        now = int(time.time() * 1000)
        metrics = [
            self.entities.Metric(key, value, now, step)
            for key, value in metric_values(record).items()
        ]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        """Mark the run finished."""
        self.client.set_terminated(self.run_id)


def _wandb_resume_note(
    run_id: str, first_step: int, start: int, mode: str, refused: str | None
) -> str:
    """What a user sees of the continued W&B run: rewound and given its last steps again, or (the
    server refused a rewind) not."""
    said = f"note: logger=wandb: continuing W&B run {run_id} after step {first_step}"
    if refused is not None:
        return (
            f"{said}; W&B refused to rewind it ({refused}): up to the last step the stopped "
            "attempt logged, the run keeps that attempt's values and W&B drops this attempt's"
        )
    cut = "cut"
    if mode == "offline":
        cut += " once `wandb sync` uploads this folder after the earlier ones"
    again = ""
    if start < first_step:
        again = f", then {_steps(start + 1, first_step)} logged again from metrics.jsonl"
    return (
        f"{said}: rewound to step {start} (what earlier attempts logged after it is {cut}){again}; "
        "a killed attempt's last steps may never have reached W&B"
    )


def _steps(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"


def _mlflow_resume_note(run_id: str, first_step: int, logged: int) -> str:
    """What a user sees in the continued MLflow run: which steps hold two values, if any."""
    said = f"note: logger=mlflow: continuing MLflow run {run_id} after step {first_step}"
    if logged <= first_step:
        return said
    return (
        f"{said}; MLflow cannot remove a logged value: the stopped attempt's values at "
        f"{_steps(first_step + 1, logged)} stay in the history beside this attempt's (the later "
        f"timestamp at each step; tag {RESUMES_TAG}: FIRST_STEP@MILLISECONDS of each resume)"
    )


def _mlflow_params_note(run_id: str, changed: Mapping[str, tuple[str, str]]) -> str:
    shown = ", ".join(f"{key} {old} -> {new}" for key, (old, new) in list(changed.items())[:5])
    more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
    return (
        f"note: logger=mlflow: MLflow keeps a parameter's first value, so run {run_id} keeps the "
        f"earlier attempt's parameters where this attempt's differ: {shown}{more}"
    )


def _mlflow_lost_note(recorded: str, run_id: str, first_step: int) -> str:
    return (
        f"note: logger=mlflow: the MLflow run {recorded} this folder logged to is deleted or gone "
        f"from the store; steps from {first_step + 1} go to a new run, {run_id}"
    )


def open_logger(
    target: str,
    options: dict,
    output_dir: Path,
    first_step: int,
    hparams: dict,
    writer: bool = True,
) -> MetricsLogger:
    """The logger class ``target`` names, built with its ``options``, with ``hparams`` (the run's
    config) logged; a :class:`NoLogger` where this process is not the ``writer`` (one rank logs)."""
    if not writer:
        return NoLogger(output_dir)
    logger = target_class("logger", target)(output_dir=output_dir, first_step=first_step, **options)
    logger.log_hparams(hparams)
    return logger
