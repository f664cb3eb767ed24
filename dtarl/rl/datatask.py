"""A dataset as the trainer's source of problems (``data.train_files``).

    task = DatasetTask(train=train, val=val)     # the PromptDatasets of DataSection.build
    task.take(position, n)                       # the problems at stream positions
                                                 # position .. position + n - 1
    task.held_out(n)                             # evaluation problems

A ``DatasetTask`` has the procedural tasks' interface (``max_turns``, ``stop_strings``,
``generate``, ``reward``, ``tool``) so that the rest of the trainer treats both alike;
the trainer draws its problems with ``take`` at its ``data_cursor`` (the position is
the dataset's whole state, see ``dtarl.data.dataset``). Each problem carries its row's
answer (the ground truth), ``data_source``, ``extra_info`` and the row itself
(``Problem.row``) to the reward function.

``reward`` is the built-in exact final-answer check: the text after the last ``####``
(GSM8K's marker) of the completion, or all of it, stripped, equals the answer's
(``str(answer)``, after its own ``####`` if it has one). A run names its own reward
function for anything else.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dtarl.data.dataset import Prompt, PromptDataset
from dtarl.rl.tasks import Problem, Role

GSM8K_MARKER = "####"


def final_answer(text: str) -> str:
    """The text after the last ``####``, or the whole text; stripped, without the
    thousands separators GSM8K's answers sometimes carry (``1,000`` -> ``1000``)."""
    tail = text.rsplit(GSM8K_MARKER, 1)[-1]
    return tail.strip().replace(",", "")


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class DatasetTask:
    train: PromptDataset
    val: PromptDataset | None = None
    max_turns = 1
    stop_strings = ()
    kind = None  # not a procedural TaskKind

    @staticmethod
    def problem(prompt: Prompt) -> Problem:
        row = prompt.row
        ref = () if row.response is None else ((Role.ASSISTANT, row.response),)
        return Problem(
            prompt=prompt.text,
            answer=row.answer,
            reference=ref,
            prompt_ids=prompt.ids,
            data_source=row.data_source,
            extra_info=row.extra_info,
            row=row,
        )

    def take(self, position: int, n: int) -> list[Problem]:
        """The training problems at stream positions ``position`` .. ``position + n - 1``."""
        return [self.problem(p) for p in self.train.take(position, n)]

    def generate(self, rng: np.random.Generator, n: int) -> list[Problem]:
        """``n`` training problems drawn with ``rng`` (with replacement only when ``n``
        exceeds the rows): a sample, e.g. of prompt lengths; training uses ``take``."""
        idx = rng.choice(len(self.train), size=n, replace=n > len(self.train))
        return [self.problem(self.train.prompts[int(i)]) for i in idx]

    def held_out(self, n: int, rng: np.random.Generator) -> list[Problem]:
        """Evaluation problems: the first ``n`` validation rows in file order (all of
        them when fewer), or without ``val`` a sample of the training rows."""
        if self.val is None:
            return self.generate(rng, min(n, len(self.train)))
        return [self.problem(p) for p in self.val.prompts[:n]]

    @property
    def longest_prompt(self) -> int:
        return max(d.longest for d in (self.train, self.val) if d is not None)

    def reward(self, problem: Problem, completion: str) -> float:
        return float(final_answer(completion) == final_answer(str(problem.answer)))

    def tool(self, problem: Problem, turn_text: str) -> str | None:
        return None

    def summary(self) -> str:
        """One line for the run's log: rows, what truncation did, evaluation rows."""
        s = self.train.stats
        val = "a sample of the training rows" if self.val is None else f"{len(self.val)} rows"
        return (
            f"data: {len(self.train)} training rows ({s.rows} read, {s.dropped} dropped and "
            f"{s.truncated} truncated by data.truncation), evaluation on {val}"
        )

    def metrics(self, cursor: int) -> dict[str, int]:
        """``data/epoch`` of the stream position ``cursor`` and the rows left out or
        truncated at load (``data.truncation``)."""
        s = self.train.stats
        return {
            "data/epoch": self.train.epoch(cursor),
            "data/dropped_rows": s.dropped,
            "data/truncated_rows": s.truncated,
        }


__all__ = ["DatasetTask", "final_answer"]
