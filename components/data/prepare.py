"""Prepare the data once, in the launching process, before any rank starts; ranks only open the
result.

    source = build_source(data_group)  # conf/data/*.yaml, chosen by its _target_
    prepared = prepare_data(source, tokenizer_dir, seq_len=..., packing=..., seed=..., ...)
    # each rank: StepBatches.open(prepared.train, ...), StepBatches.open(prepared.val, ...)

The records are tokenized and checked once per (records, tokenizer with its chat template,
``seq_len``) and kept as Arrow files under ``<cache_root>/data/<key>/tokens``, which a later run on
the same data, in any ``output_dir``, reuses. The split and the packing are small index files beside
it, so changing ``seed``, ``val_fraction`` or packing never re-tokenizes. A crash or a killed
launcher leaves nothing running or half-written.

Docs: docs/data.md
"""

import hashlib
import json
import os
import random
import re
import shutil
import signal
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
from transformers import AutoTokenizer

from components.data.collate import Labelling, check_template, record_error, tokenize_batch
from components.data.jsonl import DataError
from components.data.loader import MixedSplit, TokenizedSplit, open_tokens, pad_id_of
from components.data.packing import Rows, build_rows
from components.data.sources import DataSource, MixSource, part_named
from components.data.stream_mixture import StreamedMixSplit, is_streamed
from components.data.streaming import RowMaking, StreamedSource, StreamedSplit, first_example
from components.data.tokenizer import DEFAULT_VOCAB_SIZE, train_tokenizer
from components.processes import die_with_parent, process_exists

FORMAT_VERSION = 4  # bump when the tokenized layout changes, so old cache folders are not read
TOKENS = datasets.Features(
    {
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "labels": datasets.Sequence(datasets.Value("int32")),
        "length": datasets.Value("int32"),
        "labelled": datasets.Value("int32"),
    }
)
# Records per map call, and so per Arrow record batch of the tokenized files: opening a
# memory-mapped file reads every batch's header, and the kernel maps ~64 KB around each, so fewer
# batches, less RSS.
WRITER_BATCH_SIZE = 20_000
# Below this many records per process, starting map's worker processes costs more than it saves.
RECORDS_PER_PROCESS = 20_000
# The scratch folders of one process: ``<key>.tmp-PID`` (tokens), ``<name>.PID.tmp`` (a tokenizer).
SCRATCH = re.compile(r"\.tmp-(\d+)$|\.(\d+)\.tmp$")


@dataclass(frozen=True, kw_only=True)
class PreparedData:
    """The prepared data of a run (picklable, handed to every rank). ``val`` is None when none is
    held out."""

    train: TokenizedSplit | MixedSplit | StreamedSplit | StreamedMixSplit
    val: TokenizedSplit | MixedSplit | None
    folder: str
    reused: bool  # the tokenized records came from the cache
    tokenizer_digest: str  # of the tokenizer that made them (:func:`tokenizer_digest`)
    repaired: str | None = None  # what was damaged in the cache and made again, if anything
    # a mixture's sources' validation splits by name (val_loss/<name>); empty for one source
    val_sources: dict[str, TokenizedSplit] = field(default_factory=dict)


def data_cache_dir(cache_root: str | Path) -> Path:
    """Where prepared data lives under the shardtune cache (``$SHARDTUNE_CACHE`` or
    ``~/.cache/shardtune``)."""
    return Path(cache_root).expanduser() / "data"


def source_cache_dir(cache_root: str | Path) -> Path:
    """Where ``datasets`` keeps its Arrow conversion of local source files (pass to
    ``source.texts``)."""
    return data_cache_dir(cache_root) / "sources"


def tokenizer_digest(tokenizer) -> str:
    """A hash of everything that decides token ids: vocabulary, merges, normalisation, chat
    template, the special tokens' strings (a chat template renders ``bos_token`` and the like by
    name), eos and pad."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = (
        backend.to_str()
        if backend is not None
        else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    )
    specials = str(
        sorted((name, str(value)) for name, value in tokenizer.special_tokens_map.items())
    )
    parts = [
        state,
        str(tokenizer.chat_template),
        specials,
        str(tokenizer.eos_token_id),
        str(pad_id_of(tokenizer)),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


# This process's pid while its Dataset.map forks workers (empty otherwise): see _dies_with_mapper.
_MAPPING: list[int] = []


def _dies_with_mapper() -> None:
    """Run in every child forked from this process: a map worker (forked while ``_MAPPING`` names
    its parent) dies with the launcher, from its first instruction on (a killed launcher left its
    workers running at full CPU, re-parented to init), and leaves Ctrl-C to the launcher (which
    ends them), so a worker prints no traceback of its own. Any other fork is left alone."""
    if _MAPPING and os.getppid() == _MAPPING[0]:
        die_with_parent(_MAPPING[0])
        signal.signal(signal.SIGINT, signal.SIG_IGN)


os.register_at_fork(after_in_child=_dies_with_mapper)  # map's workers are forked (multiprocess)


def remove_stale_scratch(folder: Path) -> None:
    """Remove the scratch folders under ``folder`` whose process no longer exists (a launcher killed
    while it tokenized or trained a tokenizer). A live process's, or one of another host sharing the
    cache whose pid is alive here, is left alone."""
    if not folder.is_dir():
        return
    for child in folder.iterdir():
        if (match := SCRATCH.search(child.name)) and not process_exists(int(match[1] or match[2])):
            shutil.rmtree(child, ignore_errors=True)


def _tokenize(
    source: DataSource,
    tokenizer,
    seq_len: int,
    loss_on: str,
    num_proc: int,
    cache_root: Path,
    folder: Path,
) -> None:
    """Tokenize every record into ``folder/tokens`` (via a temporary folder renamed at the end).

    The Arrow files are map's own output (one per worker), kept as they are: no second copy, and
    written in large record batches, so a rank that memory-maps them touches ~64 KB per 20,000 rows
    to find them instead of per 1,000 rows (``save_to_disk`` would rewrite them in 1,000-row
    batches).
    """
    scratch = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        raw = source.load(source_cache_dir(cache_root))
        processes = max(1, min(num_proc, len(raw) // RECORDS_PER_PROCESS))
        _MAPPING[:] = [os.getpid()]
        tokens = raw.map(
            tokenize_batch,
            batched=True,
            batch_size=WRITER_BATCH_SIZE,  # map writes one Arrow record batch per call
            fn_kwargs={"tokenizer": tokenizer, "seq_len": seq_len, "loss_on": loss_on},
            remove_columns=raw.column_names,
            features=TOKENS,
            num_proc=processes if processes > 1 else None,
            cache_file_name=str(scratch / "tokens" / "tokens.arrow"),
            writer_batch_size=WRITER_BATCH_SIZE,
            new_fingerprint=folder.name,
        )
        labelled = tokens.data.column("labelled").to_numpy()
        bad = np.flatnonzero(labelled <= 0)
        if len(bad):
            index, group = int(bad[0]), source.examples_per_record
            raise record_error(index, raw[index], tokenizer, seq_len, loss_on, group)
        del tokens
        (scratch / "meta.json").write_text(
            json.dumps({"num_examples": len(labelled), "seq_len": seq_len})
        )
        try:
            scratch.rename(folder)
        except OSError:  # another launcher finished the same folder first: use theirs
            if not (folder / "meta.json").is_file():
                raise
    except Exception as error:
        if _interrupted(error):  # Ctrl-C, which map's pool re-raises as its own TimeoutError
            raise KeyboardInterrupt from None
        raise
    finally:
        _MAPPING.clear()
        shutil.rmtree(scratch, ignore_errors=True)


def _interrupted(error: BaseException) -> bool:
    """Whether ``error`` was raised while handling a KeyboardInterrupt (or caused by one)."""
    for _ in range(16):  # a chain of causes is short; a cycle ends here too
        if error is None or isinstance(error, KeyboardInterrupt):
            return error is not None
        error = error.__cause__ or error.__context__
    return False


def grouped_split(
    n: int, val_fraction: float, seed: int, group: int
) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) example indices of ``n`` examples in records of ``group`` consecutive ones:
    :func:`split_indices` of the records, each record's examples kept together."""
    parts = split_indices(n // group, val_fraction, seed)
    offsets = np.arange(group, dtype=np.int64)
    return tuple((records[:, None] * group + offsets).ravel() for records in parts)


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) record indices, each ascending: ``random.Random(seed).sample`` holds out a
    ``val_fraction`` of ``range(n)`` (at least one record when ``val_fraction`` > 0, and at least
    one stays for training).

    Raises:
        ValueError: If ``val_fraction`` is not in [0, 1) or leaves no training record.
    """
    if not 0 <= val_fraction < 1:
        raise ValueError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
    n_val = max(1, round(n * val_fraction)) if val_fraction > 0 else 0
    if n_val >= n:
        raise ValueError(
            f"data.val_fraction ({val_fraction}) of {n} records leaves none for training: lower "
            "it or add records"
        )
    held_out = np.zeros(n, dtype=bool)
    held_out[random.Random(seed).sample(range(n), n_val)] = True
    return np.flatnonzero(~held_out), np.flatnonzero(held_out)


def _write_rows(
    folder: Path, val_fraction: float, seed: int, packing: bool, seq_len: int, group: int
) -> Path:
    """The split and row boundaries for (val_fraction, seed, packing), written once beside the
    tokens; ``group``: examples per record, kept in one row (a preference pair's two)."""
    rows_file = folder / f"rows-v{val_fraction!r}-s{seed}-{'packed' if packing else 'rows'}.npz"
    if rows_file.is_file():
        return rows_file
    table = open_tokens(str(folder / "tokens")).data
    lengths, labelled = table.column("length").to_numpy(), table.column("labelled").to_numpy()
    del table
    train, val = grouped_split(len(lengths), val_fraction, seed, group)
    arrays: dict[str, np.ndarray] = {}
    build_rows(lengths, labelled, train, seq_len, packing, group).save_into(arrays, "train")
    build_rows(lengths, labelled, val, seq_len, False, group).save_into(
        arrays, "val"
    )  # validation per example
    private = rows_file.with_name(f"{rows_file.stem}.{os.getpid()}.tmp.npz")
    np.savez(private, **arrays)
    os.replace(private, rows_file)
    return rows_file


def writable_cache(cache_root: str | Path) -> Path:
    """The data folder of the cache, created and shown writable.

    Raises:
        DataError: Naming the folder and why (not a folder, read-only, no space), and the fix.
    """
    folder = data_cache_dir(cache_root)
    probe = folder / f".probe.{os.getpid()}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise DataError(
            f"the cache folder {folder} cannot be written ({error.strerror or error}): set "
            "SHARDTUNE_CACHE (or cache_dir=) to a writable folder"
        ) from None
    return folder


def _tokens_damage(folder: Path, seq_len: int) -> str | None:
    """Why the tokens cached in ``folder`` cannot be used (meta.json unreadable, Arrow files that do
    not open or hold another number of records), or None when they can."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        count = int(meta["num_examples"])
        if meta.get("seq_len") != seq_len:
            return f"meta.json says seq_len {meta.get('seq_len')}, not {seq_len}"
        tokens = open_tokens(str(folder / "tokens"))
    except Exception as error:  # noqa: BLE001 - a damaged file raises any of several errors
        return f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
    if tokens.features != TOKENS or len(tokens) != count:
        return f"the tokens hold {len(tokens)} records where meta.json says {count}"
    return None


def _rows_damage(
    rows_file: Path, count: int, val_fraction: float, seed: int, group: int
) -> str | None:
    """Why the split and row boundaries in ``rows_file`` are not those of ``count`` records split by
    (``val_fraction``, ``seed``): another order, boundaries outside the order, sizes that differ.
    None when they are."""
    try:
        with np.load(rows_file) as arrays:
            parts = {part: Rows.load_from(arrays, part) for part in ("train", "val")}
    except Exception as error:  # noqa: BLE001 - a damaged file raises any of several errors
        return f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
    split = grouped_split(count, val_fraction, seed, group)
    expected = dict(zip(("train", "val"), split, strict=True))
    for part, rows in parts.items():
        offsets, order = rows.offsets, rows.order
        if not np.array_equal(order, expected[part]):
            given = f"{len(expected[part])} that seed {seed} and val_fraction {val_fraction!r} give"
            return f"its {part} split holds {len(order)} records, not the {given}"
        bounded = len(offsets) > 0 and offsets[0] == 0 and offsets[-1] == len(order)
        if not bounded or np.any(np.diff(offsets) <= 0):
            return f"its {part} row boundaries do not cover the split"
        if not len(rows.tokens) == len(rows.labelled) == len(offsets) - 1:
            return f"its {part} row sizes do not match its rows"
    return None


def _chat_tokenizer(tokenizer_dir: str | Path):
    """The tokenizer of ``tokenizer_dir``; DataError (one line) without a chat template that
    renders a conversation."""
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=False)
    try:
        check_template(tokenizer)
    except ValueError as error:
        raise DataError(str(error)) from None
    return tokenizer


def prepare_data(
    source: DataSource | MixSource | StreamedSource,
    tokenizer_dir: str | Path,
    *,
    seq_len: int,
    loss_on: str,
    packing: bool,
    seed: int,
    cache_root: str | Path,
    num_proc: int,
) -> PreparedData:
    """Tokenize ``source`` with the tokenizer in ``tokenizer_dir`` (or reuse the cached result),
    split it by ``seed`` and ``source.val_fraction``, pack it when asked, and return what the ranks
    open.

    Raises:
        DataError: One line, for a source that cannot be read, a tokenizer without a chat template,
            or a record that cannot be trained on (``record 12 has no answer tokens within
            train.seq_len (48): ...``).
        ValueError: For a ``val_fraction`` that leaves no training record.
    """
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # see the module docstring: ranks fork from here
    options = dict(seq_len=seq_len, loss_on=loss_on, packing=packing, seed=seed)
    if is_streamed(source):
        rows = dict(seq_len=seq_len, loss_on=loss_on, packing=packing)
        return _prepare_stream(source, tokenizer_dir, **rows)
    if isinstance(source, MixSource):
        return _prepare_mixture(
            source, tokenizer_dir, **options, cache_root=cache_root, num_proc=num_proc
        )
    datasets.disable_progress_bars()
    tokenizer = _chat_tokenizer(tokenizer_dir)
    digest = tokenizer_digest(tokenizer)
    key = hashlib.sha256(
        f"{FORMAT_VERSION}|{source.fingerprint()}|{digest}|{seq_len}|{loss_on}".encode()
    ).hexdigest()[:20]
    folder = writable_cache(cache_root) / key
    repaired = _tokens_damage(folder, seq_len) if folder.exists() else None
    if repaired is not None:  # made again, from the records
        repaired = f"the cached tokens in {folder} were damaged ({repaired})"
        shutil.rmtree(folder, ignore_errors=True)
    reused = folder.exists()
    if not reused:
        remove_stale_scratch(folder.parent)
        _tokenize(source, tokenizer, seq_len, loss_on, num_proc, Path(cache_root), folder)
    rows_of = (folder, source.val_fraction, seed, packing, seq_len, source.examples_per_record)
    rows_file = _write_rows(*rows_of)
    count = json.loads((folder / "meta.json").read_text())["num_examples"]
    split = (source.val_fraction, seed, source.examples_per_record)
    if why := _rows_damage(rows_file, count, *split):
        repaired = f"the cached split {rows_file} was damaged ({why.strip()})"
        rows_file.unlink(missing_ok=True)
        rows_file = _write_rows(*rows_of)
    with np.load(rows_file) as rows:
        counts = {
            part: (len(rows[f"{part}_order"]), len(rows[f"{part}_offsets"]) - 1)
            for part in ("train", "val")
        }
    pad_id = pad_id_of(tokenizer)

    def split(part: str) -> TokenizedSplit:
        examples, num_rows = counts[part]
        return TokenizedSplit(
            tokens_dir=str(folder / "tokens"),
            rows_file=str(rows_file),
            part=part,
            seq_len=seq_len,
            pad_id=pad_id,
            num_examples=examples,
            num_rows=num_rows,
            pairs=source.examples_per_record == 2,
        )

    return PreparedData(
        train=split("train"),
        val=split("val") if counts["val"][0] else None,
        folder=str(folder),
        reused=reused,
        tokenizer_digest=digest,
        repaired=repaired,
    )


def _prepare_stream(
    source: StreamedSource | MixSource,
    tokenizer_dir: str | Path,
    *,
    seq_len: int,
    loss_on: str,
    packing: bool,
) -> PreparedData:
    """A streamed source, or a mixture of them: nothing tokenized ahead, no cache; each stream's
    first record is read and tokenized here, so a path, split, column mapping, template or record
    that cannot be used is one line before any rank starts."""
    tokenizer = _chat_tokenizer(tokenizer_dir)
    parts = source.parts if isinstance(source, MixSource) else ()
    streams = tuple(part.source for part in parts) or (source,)
    for stream in streams:
        first_example(stream, Labelling(tokenizer=tokenizer, seq_len=seq_len, loss_on=loss_on))
    making = RowMaking(
        tokenizer_dir=str(tokenizer_dir),
        seq_len=seq_len,
        loss_on=loss_on,
        packing=packing,
        pad_id=pad_id_of(tokenizer),
    )
    if parts:
        names, weights = tuple(p.name for p in parts), tuple(p.weight for p in parts)
        train = StreamedMixSplit(names=names, weights=weights, sources=streams, making=making)
    else:
        train = StreamedSplit(source=source, making=making)
    paths = ", ".join(stream.path for stream in streams)
    return PreparedData(
        train=train,
        val=None,
        folder=f"streamed from {paths}, no cache",
        reused=False,
        tokenizer_digest=tokenizer_digest(tokenizer),
    )


def _prepare_mixture(mix: MixSource, tokenizer_dir: str | Path, **options) -> PreparedData:
    """Each source of ``mix`` prepared as one source is (its own cache folder, split and packing),
    read as one training stream and as one validation split, and each validation split by name."""
    prepared = []
    for index, part in enumerate(mix.parts):
        with part_named(index, part.name):
            prepared.append(prepare_data(part.source, tokenizer_dir, **options))
    names = tuple(part.name for part in mix.parts)
    vals = {name: data.val for name, data in zip(names, prepared, strict=True) if data.val}
    weights = tuple(part.weight for part in mix.parts)
    train = MixedSplit(names=names, weights=weights, parts=tuple(p.train for p in prepared))
    val = MixedSplit(names=tuple(vals), weights=(1.0,) * len(vals), parts=tuple(vals.values()))
    repaired = "; ".join(data.repaired for data in prepared if data.repaired)
    return PreparedData(
        train=train,
        val=val if vals else None,
        folder=", ".join(data.folder for data in prepared),
        reused=all(data.reused for data in prepared),
        tokenizer_digest=prepared[0].tokenizer_digest,
        repaired=repaired or None,
        val_sources=vals,
    )


def cached_tokenizer(source: DataSource | MixSource, cache_root: str | Path) -> Path:
    """The byte-level BPE trained on ``source``'s texts, cached by the source's fingerprint (for a
    model built from its config). Training is deterministic, so when torchrun ranks race each writes
    a private folder and the first rename wins."""
    datasets.disable_progress_bars()  # one error line on bad data, not a progress bar before it
    folder = (
        data_cache_dir(cache_root) / "tokenizers" / f"{source.fingerprint()}-{DEFAULT_VOCAB_SIZE}"
    )
    if not folder.is_dir():
        writable_cache(cache_root)
        remove_stale_scratch(folder.parent)
        private = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
        train_tokenizer(source.texts(source_cache_dir(cache_root)), DEFAULT_VOCAB_SIZE, private)
        try:
            private.rename(folder)
        except OSError:
            shutil.rmtree(private, ignore_errors=True)
    return folder
