"""``complete(M)`` counts final stops only: a held (multi-turn) member whose turn
stopped at a tool call is extended, not complete (issue 39: a DARTS early-stopped
group was cancelled after its first decode call)."""

from __future__ import annotations

from flax import nnx

from dtarl.model.config import ModelConfig
from dtarl.model.decoder import Decoder
from dtarl.rollout.engine import ContinuousConfig, RolloutEngine, Status, complete
from dtarl.rollout.reasons import FinishReason

CFG = ModelConfig.tiny()
SMALL = ContinuousConfig(
    slots=4, groups=2, group_size=3, prompt_len=16, response_len=24, steps_per_call=4
)


def test_held_stops_count_once_released():
    model = Decoder(CFG, seed=0)
    weights = nnx.split(model, nnx.Param)[1]
    eng = RolloutEngine(model, SMALL)
    eng.submit([3, 4, 5], n=1, max_new_tokens=1, top_k=1)
    (probe,) = eng.run(weights)
    first = probe.tokens[0]  # the greedy first token: a stop, so each turn is 1 token
    g = eng.submit(
        [3, 4, 5], n=2, stop_ids=[first], top_k=1, hold=True, until=complete(1), max_new_tokens=8
    )
    a, b = eng.run(weights)
    assert {a.finish, b.finish} == {FinishReason.STOP} and a.status is Status.FINISHED
    assert not g.stopped  # both turns stopped, but neither is known to be final
    eng.extend(a, [7, 8], max_new_tokens=4)  # a's stop was a tool call
    eng.release(b)  # b's was its answer: one final stop, so the group is complete
    assert g.stopped and a.finish is FinishReason.CANCELLED
    eng.run(weights)  # the queued extend of a cancelled request decodes nothing
    assert a.finish is FinishReason.CANCELLED and a.tokens == [] and not eng.pending()
