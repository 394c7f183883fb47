"""The new leader's feed after a loss (engine/rank/elastic_serve.Feed), without processes: what
the driver sent before its resume is dropped (the resume carries it), aborts are held until the
resume's adds, an add the resume already held is not run twice, and a replica chosen before the
loss is folded onto the new replicas."""

import queue

from atoll import SamplingParams
from atoll.engine.batch.request import Request
from atoll.engine.rank.elastic_serve import Feed, Outbox


def _req(index, generated=()):
    return Request(index, [5, 6], SamplingParams(max_tokens=4), generated=list(generated))


def test_a_waiting_feed_takes_only_the_resume_and_what_follows():
    inbox = queue.Queue()
    feed = Feed(inbox, dp=2, waiting=True)
    inbox.put(("add", _req(1), 2))  # before the resume: dropped, the resume carries it
    inbox.put(("abort", 3))
    assert feed.take(0, busy=True) == []
    inbox.put(("resume", [(_req(1, [7, 8]), 1), (_req(3, [9]), 0)]))
    inbox.put(("add", _req(1), 0))  # sent after the resume for a request it held: not run twice
    inbox.put(("adds", [("add", _req(4), 2)]))  # a new one, on a replica that is gone
    out = feed.take(1, busy=True)
    assert [(c[0], c[1].index, c[1].generated, c[2]) if c[0] == "add" else c for c in out] == [
        ("add", 1, [7, 8], 1), ("add", 3, [9], 0), ("abort", 3), ("add", 4, [], 0)]
    assert feed.live == {1, 3, 4} and not feed.waiting


def test_an_ended_request_leaves_the_live_set_and_ready_is_not_sent_again():
    inbox, sent = queue.Queue(), []

    class Box:
        put = staticmethod(sent.append)

    feed = Feed(inbox, dp=1)
    inbox.put(("add", _req(1), 0))
    feed.take(0, busy=True)
    box = Outbox(Box, feed, started=True)
    box.put(("ready", {}))
    box.put(("step", [(1, 9)], [(1, {"token_ids": [9]})], {}, None))
    assert feed.live == set() and [m[0] for m in sent] == ["step"]
    inbox.put(("add", _req(1), 0))  # the same index again, once ended: a new request
    assert [c[1].index for c in feed.take(1, busy=True)] == [1]
