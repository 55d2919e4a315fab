"""Batches of prompt indices: deterministic, resumable, optionally balanced over a record field."""

from __future__ import annotations

import hashlib
import json
import logging
import random
from typing import Any

from visionrl.data.dataset import DatasetError, Sample, VisionDataset

logger = logging.getLogger(__name__)


def _derive_seed(*parts: object) -> int:
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big")


def _lookup(record: dict[str, Any], key: str) -> Any:
    """record[key], where a dotted key ("metadata.color") walks into nested objects; KeyError if absent."""
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(key)
        value = value[part]
    return value


def _group_by(dataset: VisionDataset, key: str) -> dict[str, list[int]]:
    """Rows grouped by the value of `key` (as JSON text), groups ordered by that value (not file order)."""
    groups: dict[str, list[int]] = {}
    for i, (record, record_id) in enumerate(zip(dataset.row_records, dataset.row_ids, strict=True)):
        try:
            value = _lookup(record, key)
        except KeyError:
            raise DatasetError(
                f"{dataset.path}: record {record_id!r} has no field {key!r} to balance batches on; "
                "set data.balance_key to a field every record has (e.g. 'answer'), or leave it unset"
            ) from None
        # JSON text makes any answer value (list, dict, number) a hashable, sortable group key.
        groups.setdefault(json.dumps(value, sort_keys=True), []).append(i)
    return {k: groups[k] for k in sorted(groups)}


class PromptSampler:
    """Infinite, deterministic, resumable stream of batches of dataset indices.

    Without `balance_key` the whole dataset is one stream, drawn epoch by epoch, each epoch a fresh
    permutation seeded by (seed, epoch); a batch may span two epochs. With `balance_key` (a record field;
    dotted for nested ones, e.g. "metadata.color") records are grouped by that field's value, each group is
    such a stream of its own, and every batch takes batch_size // k indices from each of the k groups, the
    batch_size % k remaining slots going to groups in a fixed rotation. Small groups are thus oversampled:
    in the demo, batches dominated by one class let the policy collapse to that answer.

    The state is only counters (batches drawn, epoch and position of each stream), so loading the
    `state_dict()` taken after n batches into a fresh sampler continues with exactly batch n + 1.
    The streams run over every row of the file, usable or not: a row whose record was skipped for a bad
    image (at load, or by `exclude` mid-run) is passed over where it comes up, so a resumed run whose data
    lost an image in between continues with the same order, minus that record.
    """

    def __init__(
        self, dataset: VisionDataset, batch_size: int, seed: int, balance_key: str | None = None
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(dataset) == 0:
            raise ValueError("cannot sample from an empty dataset")
        self.batch_size = batch_size
        self.seed = seed
        self.balance_key = balance_key
        self._num_samples = len(dataset)
        self._num_rows = len(dataset.row_records)
        self._index_of = {row: i for i, row in enumerate(dataset.usable_rows)}
        self._row_of = dataset.usable_rows
        by_value = (
            {"": list(range(self._num_rows))} if balance_key is None else _group_by(dataset, balance_key)
        )
        self._group_values, self._groups = list(by_value), list(by_value.values())
        self._group_of = {row: g for g, rows in enumerate(self._groups) for row in rows}
        self.passed_over = 0  # draws of a row without a usable record (skipped at load or excluded)
        self.excluded: set[int] = set()  # dataset indices whose images failed to decode mid-run
        for g in range(len(self._groups)):
            self._check_group(g)
        self._step = 0
        self._epoch = [0] * len(self._groups)
        self._position = [0] * len(self._groups)
        self._orders: dict[int, tuple[int, list[int]]] = {}  # group -> (epoch, permutation) cache
        self._rotation = list(range(len(self._groups)))
        random.Random(_derive_seed(seed, "rotation")).shuffle(self._rotation)

    @property
    def step(self) -> int:
        """Number of batches drawn so far."""
        return self._step

    @property
    def epochs_seen(self) -> float:
        """Indices drawn so far divided by the dataset size."""
        return self._step * self.batch_size / self._num_samples

    def __iter__(self) -> PromptSampler:
        return self

    def __next__(self) -> list[int]:
        return self.next_batch()

    def next_batch(self) -> list[int]:
        """The next `batch_size` dataset indices."""
        k = len(self._groups)
        base, extra = divmod(self.batch_size, k)
        counts = [base] * k
        for j in range(extra):
            counts[self._rotation[(self._step * extra + j) % k]] += 1
        batch = [i for g in range(k) for i in self._take(g, counts[g])]
        if k > 1:
            # Interleave the groups: a caller that splits the batch must not get one class per part.
            random.Random(_derive_seed(self.seed, "batch", self._step)).shuffle(batch)
        self._step += 1
        return batch

    def _order(self, group: int) -> list[int]:
        epoch = self._epoch[group]
        cached = self._orders.get(group)
        if cached is None or cached[0] != epoch:
            order = list(self._groups[group])
            random.Random(_derive_seed(self.seed, "epoch", group, epoch)).shuffle(order)
            cached = self._orders[group] = (epoch, order)
        return cached[1]

    def _usable(self, row: int) -> bool:
        index = self._index_of.get(row)
        return index is not None and index not in self.excluded

    def _check_group(self, group: int) -> None:
        if not any(self._usable(row) for row in self._groups[group]):
            what = (
                "" if self.balance_key is None else f" with {self.balance_key} = {self._group_values[group]}"
            )
            raise DatasetError(
                f"every record{what} has a bad image, so no prompt can be drawn; fix or replace the images"
            )

    def _take(self, group: int, count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count:
            order, pos = self._order(group), self._position[group]
            row = order[pos]
            if self._usable(row):
                out.append(self._index_of[row])
            else:
                self.passed_over += 1
            self._position[group] = pos + 1
            if self._position[group] == len(order):
                self._epoch[group] += 1
                self._position[group] = 0
        return out

    def exclude(self, index: int) -> int:
        """Stop drawing dataset index `index` (its image no longer decodes) and return its replacement:
        the next usable index of the same stream. DatasetError if that stream has no usable record left."""
        self.excluded.add(index)
        group = self._group_of[self._row_of[index]]
        self._check_group(group)
        return self._take(group, 1)[0]

    def _fingerprint(self) -> dict[str, Any]:
        return {
            "num_samples": self._num_rows,  # every row, usable or not: stable when an image goes bad
            "batch_size": self.batch_size,
            "seed": self.seed,
            "balance_key": self.balance_key,
            "group_sizes": [len(g) for g in self._groups],
        }

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position: step, per-stream `epoch` and `position` lists, and the settings."""
        return {
            "step": self._step,
            "epoch": list(self._epoch),
            "position": list(self._position),
            **self._fingerprint(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; ValueError if the data or the sampler settings differ from when it was taken."""
        expected = self._fingerprint()
        changed = [f"{k} was {state.get(k)!r}, now {v!r}" for k, v in expected.items() if state.get(k) != v]
        if changed:
            raise ValueError(
                "cannot resume the prompt sampler: " + "; ".join(changed) + ". The data file or the data "
                "settings changed since the checkpoint; restore them, or start the data order afresh"
            )
        epoch, position = list(state["epoch"]), list(state["position"])
        sizes = [len(g) for g in self._groups]
        valid = len(epoch) == len(position) == len(sizes)
        if not valid or not all(0 <= p < n for p, n in zip(position, sizes, strict=True)):
            raise ValueError(f"cannot resume the prompt sampler: malformed state {state!r}")
        self._step, self._epoch, self._position = int(state["step"]), epoch, position


def draw_samples(dataset: VisionDataset, sampler: PromptSampler) -> list[Sample]:
    """The next batch of samples, images decoded. A record whose image no longer decodes (the file changed
    after the load-time check) is skipped, counted in `sampler.excluded` and replaced from the same stream,
    so a long run does not die on it."""
    out = []
    for index in sampler.next_batch():
        while True:
            try:
                out.append(dataset[index])
                break
            except DatasetError as err:
                logger.warning("skipping a record whose image failed to decode: %s", err)
                index = sampler.exclude(index)
    return out
