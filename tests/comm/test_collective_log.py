"""The job's collective sequence (comm/sequence.py): positions as beats carry them, and the first
disagreement between replicas (issue 53)."""

from __future__ import annotations

import torch

from stratagem.comm.heartbeat import BeatBook, decode_beat, decode_beat_where, encode_beat
from stratagem.comm.sequence import (
    CollectiveLog,
    Position,
    describe,
    disagreement,
    explain,
    odd_one,
)


def test_a_position_rides_in_a_beat_and_reads_back():
    pos = Position(57, "all_reduce float32[10]", group=1)
    raw = encode_beat(13, "run", pos.encode())
    assert raw == "13 run 1.57:all_reduce/float32[10]"
    assert decode_beat(raw) == (13, "run")  # what the older readers take from it
    n, state, where = decode_beat_where(raw)
    assert (n, state, Position.decode(where)) == (13, "run", pos)
    assert decode_beat_where("12 done") == (12, "done", "")
    assert Position.decode("") is None and Position.decode("garbage") is None


def test_the_book_keeps_each_ranks_last_position():
    book = BeatBook()
    book.see(1, "4 run 0.9:barrier", 0.0)
    book.see(1, "5 run", 1.0)
    assert book.wheres[1] == ""


def test_the_log_numbers_collectives_and_says_the_oldest_one_waited_in():
    log = CollectiveLog()
    assert log.position() is None
    first = log.start()  # started asynchronously, not waited for yet
    with log.collective("broadcast int64[2]"):
        assert log.position() == Position(2, "broadcast int64[2]")
        with log.waiting(first, "all_reduce float32[4]"):
            assert log.position() == Position(1, "all_reduce float32[4]")
    assert log.position() is None
    log.reset()  # the group formed again: numbered afresh, never compared with the old group's
    with log.collective("barrier"):
        assert log.position() == Position(1, "barrier", group=1)


def test_describe_names_what_every_member_must_match():
    t = torch.zeros(2, 3)
    assert describe("all_reduce", t) == "all_reduce float32[6]"
    assert describe("all_to_all", t, sized=False) == "all_to_all float32"
    assert describe("barrier") == "barrier"


def test_only_one_number_in_different_collectives_is_a_disagreement():
    same = {0: Position(9, "all_reduce float32[13]"), 1: Position(9, "all_reduce float32[13]"),
            2: Position(8, "broadcast int64[1]")}  # rank 2 waits in an earlier one: not comparable
    assert disagreement(same) is None
    other_group = {0: Position(9, "all_reduce float32[13]", 0), 1: Position(9, "barrier", 1)}
    assert disagreement(other_group) is None
    mixed = {0: Position(9, "all_reduce float32[13]"), 1: Position(9, "all_gather float32[3]"),
             2: Position(9, "all_reduce float32[13]")}
    seq, by_what = disagreement(mixed)
    assert seq == 9 and by_what == {"all_reduce float32[13]": [0, 2], "all_gather float32[3]": [1]}
    assert odd_one(by_what) == 1
    text = explain(seq, by_what)
    assert "collective #9 of the job: ranks 0, 2 in all_reduce float32[13]; rank 1 in all_gather float32[3]" in text
    assert "must make the same collectives in the same order" in text
