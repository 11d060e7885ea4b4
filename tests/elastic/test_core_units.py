"""The unit queue, the rendezvous file, the policy store and the service's secret: fast, real files,
a real socket (the end-to-end join is in test_core_join.py)."""

from __future__ import annotations

import json
import os
import stat
import threading
import urllib.error
import urllib.request

import pytest

from beam_hpc.backends.reference.rollouts import policy_store, rendezvous, unit_server
from beam_hpc.backends.reference.rollouts.unit_server import (
    AUTH_HEADER,
    Client,
    ElasticServer,
    Service,
    ServiceError,
    check_header,
    sign,
    verify,
)
from beam_hpc.backends.reference.rollouts.units import Unit, UnitQueue, cut, seed_parts, within_staleness


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _units(rollout: int = 0, n_prompts: int = 4, unit_prompts: int = 1, version: int = 0) -> list[Unit]:
    prompts = [[i, i + 1] for i in range(n_prompts)]
    return cut("train", rollout, prompts, [str(i) for i in range(n_prompts)], samples_per_prompt=2, train=True,
               version=version, unit_prompts=unit_prompts)


def _result(tag: str, version: int = 0) -> dict[str, object]:
    return {"reward": [1.0, 0.0], "tag": tag, "version": version}


def test_units_are_cut_by_size_never_by_worker_count_and_seeded_by_prompt_index() -> None:
    units = _units(n_prompts=5, unit_prompts=2)
    assert [(u.index, u.first_prompt, len(u.prompts)) for u in units] == [(0, 0, 2), (1, 2, 2), (2, 4, 1)]
    assert [u.key for u in units] == ["train:0:0", "train:0:1", "train:0:2"]
    assert seed_parts(7, units[1]) == (7, "train", 0, "prompt", 2)
    assert Unit.from_json(json.loads(json.dumps(units[2].to_json()))) == units[2]
    with pytest.raises(ValueError, match="unit_prompts"):
        _units(unit_prompts=0)


def test_lease_complete_collect_and_a_late_duplicate_is_dropped_and_counted() -> None:
    q = UnitQueue()
    q.register("segment:0", outside=False)
    q.register("w1", outside=True)
    keys = q.add(_units())
    got = [q.lease("w1"), q.lease("segment:0")]
    assert [u.key for u in got if u] == keys[:2]
    assert q.complete("w1", keys[0], _result("w1")) == "accepted"
    assert q.complete("segment:0", keys[0], _result("again")) == "duplicate"
    for k in keys[1:]:
        if k != keys[1]:
            assert q.lease("segment:0") is not None
        assert q.complete("segment:0", k, _result("own")) == "accepted"
    assert q.done(keys) and q.wait(keys, 0.1)
    out = q.collect(keys)
    assert [r["served_by"] for r in out] == ["w1", "segment:0", "segment:0", "segment:0"]
    assert out[0]["tag"] == "w1"  # the first result stays, the duplicate never replaced it
    assert q.complete("w1", keys[0], _result("late")) == "duplicate"  # after the rollout was collected too
    assert q.stats()["duplicates"] == 2 and q.stats()["served"] == {"segment:0": 3, "w1": 1}


def test_a_silent_outside_worker_loses_its_lease_and_the_unit_is_served_once_by_another() -> None:
    clock = Clock()
    q = UnitQueue(lease_s=10, clock=clock)
    q.register("segment:0", outside=False)
    q.register("w1", outside=True)
    keys = q.add(_units(n_prompts=2))
    assert q.lease("w1").key == keys[0]
    clock.now = 5
    assert q.heartbeat("w1") and q.expire() == []
    clock.now = 16  # 11 s without a word
    assert q.expire() == ["w1"] and q.outside_workers() == []
    assert q.heartbeat("w1") is False  # it must register again
    assert q.lease("segment:0").key == keys[0]  # first in line again
    assert q.stats()["reissued"] == 1
    assert q.complete("segment:0", keys[0], _result("own")) == "accepted"
    assert q.complete("w1", keys[0], _result("w1-late")) == "duplicate"
    assert q.lease("segment:0").key == keys[1]
    assert q.complete("segment:0", keys[1], _result("own")) == "accepted"
    assert [r["served_by"] for r in q.collect(keys)] == ["segment:0", "segment:0"]
    clock.now = 1000
    assert q.expire() == []  # the segment's own workers never expire


def test_give_back_and_deregister_put_units_back_first_in_line() -> None:
    q = UnitQueue()
    for w in ("w1", "w2"):
        q.register(w, outside=True)
    keys = q.add(_units(n_prompts=3))
    a, b = q.lease("w1"), q.lease("w1")
    assert (a.key, b.key) == (keys[0], keys[1])
    assert q.give_back("w1", [keys[1]]) == [keys[1]]
    assert q.lease("w2").key == keys[1]
    assert q.deregister("w1") == [keys[0]]
    assert q.lease("w2").key == keys[0]
    assert q.lease("w1") is None  # gone: it gets nothing until it registers again
    assert q.stats()["reissued"] == 2


def test_own_workers_take_a_unit_an_outside_worker_holds_only_when_nothing_waits() -> None:
    q = UnitQueue()
    q.register("segment:0", outside=False)
    q.register("w1", outside=True)
    keys = q.add(_units(n_prompts=2))
    assert q.lease("w1").key == keys[0]
    assert q.lease("segment:0", steal=True).key == keys[1]  # a waiting unit first
    assert q.lease("segment:0", steal=True).key == keys[0]  # then the outside worker's
    assert q.lease("segment:0", steal=True) is None  # never its own twice
    assert q.complete("segment:0", keys[0], _result("own")) == "accepted"
    assert q.complete("w1", keys[0], _result("w1")) == "duplicate"


def test_a_feeder_sleeps_until_the_queue_changes_and_no_change_is_slept_on() -> None:
    """What the driver's feeder waits on instead of polling: a change since the count it read
    before leasing returns at once (an add it raced is not slept on), no change waits the timeout
    out, and an add, a result, a unit put back or a registration from another thread wakes it."""
    import time

    q = UnitQueue()
    q.register("segment:0", outside=False)
    seen = q.changes
    q.add(_units(n_prompts=1))
    t0 = time.monotonic()
    assert q.wait_for_change(seen, timeout=5.0) == seen + 1 and time.monotonic() - t0 < 1.0
    t0 = time.monotonic()
    assert q.wait_for_change(seen + 1, timeout=0.2) == seen + 1 and time.monotonic() - t0 >= 0.2
    unit = q.lease("segment:0")
    assert unit is not None
    for wake in (lambda: q.complete("segment:0", unit.key, {"reward": [1.0]}),
                 lambda: q.register("outside-a", outside=True), q.poke):
        now = q.changes
        threading.Timer(0.1, wake).start()
        t0 = time.monotonic()
        assert q.wait_for_change(now, timeout=5.0) == now + 1 and time.monotonic() - t0 < 2.0
    held = q.add(_units(rollout=1, n_prompts=1))
    assert q.lease("outside-a") is not None
    now = q.changes
    threading.Timer(0.1, lambda: q.deregister("outside-a")).start()  # its unit goes back
    assert q.wait_for_change(now, timeout=5.0) > now and q.lease("segment:0").key == held[0]


def test_accept_filters_what_an_outside_worker_may_take() -> None:
    q = UnitQueue()
    q.register("w1", outside=True)
    q.add(_units(rollout=0, n_prompts=1, version=0) + _units(rollout=1, n_prompts=1, version=1))
    assert q.lease("w1", lambda u: u.version == 1).key == "train:1:0"
    assert q.lease("w1", lambda u: u.version == 1) is None
    assert q.versions_wanted() == {0, 1}


def test_staleness_sync_serves_only_the_current_version_async_at_most_the_allowed_lag() -> None:
    assert within_staleness(5, 5, 0) and not within_staleness(4, 5, 0)
    assert within_staleness(4, 5, 1) and within_staleness(5, 5, 1) and not within_staleness(3, 5, 1)
    assert not within_staleness(6, 5, 1)  # a version the trainer has not reached is never valid


def test_rendezvous_is_private_atomic_and_removed_only_by_its_segment(tmp_path) -> None:
    assert rendezvous.read(tmp_path) is None
    rv = rendezvous.Rendezvous("12-0", "127.0.0.1", 4242, rendezvous.new_secret(), 5, True, 0,
                               str(policy_store.policy_dir(tmp_path)))
    p = rendezvous.write(tmp_path, rv)
    assert p == tmp_path / "elastic" / "rendezvous.json"
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    assert set(json.loads(p.read_text())) == {"segment", "address", "port", "secret", "run_seed", "sync",
                                              "max_staleness", "policy_dir"}
    assert rendezvous.read(tmp_path) == rv and len(rv.secret) == 64
    rendezvous.remove(tmp_path, "13-0")  # another segment's driver leaves it alone
    assert rendezvous.read(tmp_path) == rv
    rendezvous.remove(tmp_path, "12-0")
    assert rendezvous.read(tmp_path) is None
    p.write_text("{not json")
    assert rendezvous.read(tmp_path) is None


def test_policy_versions_are_immutable_checksummed_and_pruned(tmp_path) -> None:
    import torch

    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3)}
    assert policy_store.latest(tmp_path) is None
    assert policy_store.publish(tmp_path, 3, state)
    assert not policy_store.publish(tmp_path, 3, {"w": torch.zeros(1)})  # immutable: the first stays
    assert policy_store.publish(tmp_path, 4, {k: v + 1 for k, v in state.items()})
    assert policy_store.versions(tmp_path) == [3, 4] and policy_store.latest(tmp_path) == 4
    got = policy_store.load_verified(tmp_path, 3)
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)
    manifest = json.loads((policy_store.version_dir(tmp_path, 3) / policy_store.MANIFEST).read_text())
    assert manifest["version"] == 3 and set(manifest["files"]) == {policy_store.WEIGHTS}
    weights = policy_store.version_dir(tmp_path, 4) / policy_store.WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-9] ^= 0xFF  # one flipped bit of payload
    weights.write_bytes(bytes(data))
    with pytest.raises(policy_store.PolicyVersionError, match="policy version 4: weights.pt has sha256"):
        policy_store.load_verified(tmp_path, 4)
    with pytest.raises(policy_store.PolicyVersionError, match="no readable manifest"):
        policy_store.load_verified(tmp_path, 9)
    assert policy_store.prune(tmp_path, 4) == [3] and policy_store.versions(tmp_path) == [4]


def test_a_manifest_must_list_the_weights_and_name_only_files_of_its_own_directory(tmp_path) -> None:
    import hashlib

    import torch

    assert policy_store.publish(tmp_path, 1, {"w": torch.ones(2)})
    d = policy_store.version_dir(tmp_path, 1)
    good = json.loads((d / policy_store.MANIFEST).read_text())
    outside = tmp_path / "elsewhere.pt"
    outside.write_bytes(b"not in the version directory")
    sha_out = hashlib.sha256(outside.read_bytes()).hexdigest()
    cases = {
        "does not list weights.pt": {**good, "files": {}},
        "not a plain file name": {**good, "files": {**good["files"], "../../elsewhere.pt": sha_out}},
        "not a plain file name ": {**good, "files": {**good["files"], str(outside): sha_out}},
        "no sha256": {**good, "files": {policy_store.WEIGHTS: 5}},
        "not this version's": {**good, "version": 2},
    }
    for why, manifest in cases.items():
        (d / policy_store.MANIFEST).write_text(json.dumps(manifest))
        with pytest.raises(policy_store.PolicyVersionError, match=why.strip()):
            policy_store.load_verified(tmp_path, 1)
    # a listed name that is a symbolic link (here: to a file with the listed digest) is refused too
    (d / "extra.bin").symlink_to(outside)
    (d / policy_store.MANIFEST).write_text(json.dumps({**good, "files": {**good["files"], "extra.bin": sha_out}}))
    with pytest.raises(policy_store.PolicyVersionError, match="extra.bin is not a plain file"):
        policy_store.load_verified(tmp_path, 1)
    (d / policy_store.MANIFEST).write_text(json.dumps(good))
    assert torch.equal(policy_store.load_verified(tmp_path, 1)["w"], torch.ones(2))


def test_signatures_bind_secret_path_body_length_digest_and_time() -> None:
    h = sign("s3cret", "/lease", b"{}", now=1000)
    assert verify("s3cret", "/lease", b"{}", h, now=1000)
    assert not verify("other", "/lease", b"{}", h, now=1000)
    assert not verify("s3cret", "/result", b"{}", h, now=1000)
    assert not verify("s3cret", "/lease", b'{"x":1}', h, now=1000)
    assert not verify("s3cret", "/lease", b"{}", h, now=1000 + 301)  # too old
    assert not verify("s3cret", "/lease", b"{}", None) and not verify("s3cret", "/lease", b"{}", "garbage")
    # the header alone vouches for the body's length and digest: checked before a byte is read
    proof = check_header("s3cret", "/lease", h, now=1000)
    assert proof is not None and proof.length == 2 and unit_server.body_matches(proof, b"{}")
    assert not unit_server.body_matches(proof, b"[]")  # same length, other bytes
    ts, nonce, length, digest, mac = h.split(":")
    for forged in (f"{ts}:{nonce}:99:{digest}:{mac}", f"{ts}:{'0' * 32}:{length}:{digest}:{mac}",
                   f"{int(ts) + 1}:{nonce}:{length}:{digest}:{mac}", f"{ts}:{nonce}:{length}:{'0' * 64}:{mac}"):
        assert check_header("s3cret", "/lease", forged, now=1000) is None, forged
    assert sign("s3cret", "/lease", b"{}", now=1000) != sign("s3cret", "/lease", b"{}", now=1000)  # a fresh nonce each


def test_a_nonce_is_good_once_and_forgotten_only_after_the_window() -> None:
    clock = Clock()
    clock.now = 1000.0
    book = unit_server.NonceBook(window_s=300, clock=clock)
    p = check_header("k", "/lease", sign("k", "/lease", b"{}", now=1000), now=1000)
    assert p is not None and book.first_use(p) and not book.first_use(p)
    clock.now = 1299.0
    assert not book.first_use(p)  # still within the window: a replay
    clock.now = 1311.0  # swept after the window; the header itself is too old by now
    book.first_use(check_header("k", "/lease", sign("k", "/lease", b"{}", now=1311), now=1311))
    assert p.nonce not in book.seen


@pytest.fixture
def service():
    q = UnitQueue()
    q.register("segment:0", outside=False)
    registered: list[str] = []
    svc = Service(q, "7-0", {"model_path": "/m"}, accept=lambda u: u.version == 0, on_register=registered.append)
    server = ElasticServer(svc, "the-secret", "127.0.0.1").start()
    yield q, server, registered
    server.close()


def test_the_service_refuses_a_client_without_the_secret_on_a_real_socket(service) -> None:
    q, server, _ = service
    url = f"http://127.0.0.1:{server.port}"
    with pytest.raises(ServiceError) as err:
        Client(url, "wrong-secret").call("/register", worker="intruder")
    assert err.value.code == 401
    body = json.dumps({"worker": "intruder"}).encode()
    for headers in ({}, {AUTH_HEADER: "1:deadbeef"}):  # no proof, a forged one
        req = urllib.request.Request(url + "/register", data=body, method="POST", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as http:
            urllib.request.urlopen(req, timeout=10)
        assert http.value.code == 401
    assert q.outside_workers() == []  # nobody got in
    # nor does a client make the driver read a body of any size it claims before the proof is checked
    import socket

    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /register HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999999\r\n\r\n")
        assert sock.recv(200).split(b"\r\n")[0].endswith(b"413 Request Entity Too Large")


def test_the_service_registers_leases_takes_results_and_gives_back(service) -> None:
    q, server, registered = service
    c = Client(f"http://127.0.0.1:{server.port}", "the-secret")
    keys = q.add(_units(n_prompts=3) + _units(rollout=1, n_prompts=1, version=1))
    with pytest.raises(ServiceError) as err:
        c.call("/lease", worker="w1", segment="7-0", session="x")
    assert err.value.code == 409  # not registered with this segment
    hello = c.call("/register", worker="w1")
    s1 = hello.pop("session")
    assert hello == {"segment": "7-0", "model_path": "/m"} and registered == ["w1"] and len(s1) == 32
    me = {"worker": "w1", "segment": "7-0", "session": s1}
    for stranger in ({**me, "segment": "6-0"}, {**me, "session": "0" * 32}, {"worker": "w1", "segment": "7-0"}):
        with pytest.raises(ServiceError) as err:  # an earlier segment's registration, or not this registration
            c.call("/lease", **stranger)
        assert err.value.code == 409
    unit = Unit.from_json(c.call("/lease", **me)["unit"])
    assert unit.key == keys[0]
    assert c.call("/result", **me, key=unit.key, result=_result("w1")) == {"verdict": "accepted"}
    assert c.call("/result", **me, key=unit.key, result=_result("w1")) == {"verdict": "duplicate"}
    held = [Unit.from_json(c.call("/lease", **me)["unit"]).key for _ in range(2)]
    assert held == keys[1:3]
    assert c.call("/lease", **me) == {"wait_s": 0.2}  # version 1 is not for it
    assert c.call("/heartbeat", **me) == {}
    out = c.call("/deregister", **me, give_back=[keys[1]])
    assert sorted(out["given_back"]) == sorted(keys[1:3])
    assert [q.lease("segment:0").key for _ in range(3)] == [keys[2], keys[1], keys[3]]  # given back: first in line


def test_a_result_is_taken_only_from_the_leaseholder_at_the_leased_version_and_after_the_check(service) -> None:
    """Another worker's unit, a result at another version, a result the check refuses, a unit
    nobody leased: each is refused without ending anything, and the unit is served again."""
    q, server, _ = service
    checked: list[str] = []

    def check(unit: Unit, result: dict) -> dict:
        checked.append(unit.key)
        if result.get("tag") == "bad":
            raise unit_server.ResultRefused("reward: 2 entries; 3 samples")
        return {**result, "checked": True}

    server.service.check = check
    c = Client(f"http://127.0.0.1:{server.port}", "the-secret")
    keys = q.add(_units(n_prompts=2))
    a = {"worker": "a", "segment": "7-0", "session": c.call("/register", worker="a")["session"]}
    b = {"worker": "b", "segment": "7-0", "session": c.call("/register", worker="b")["session"]}
    assert c.call("/lease", **a)["unit"]["index"] == 0
    for who, result, code in ((b, _result("b"), 409), (a, _result("a", version=1), 400), (a, _result("a", version=True), 400)):
        with pytest.raises(ServiceError) as err:
            c.call("/result", **who, key=keys[0], result=result)
        assert err.value.code == code, (who, result)
        if code == 400:  # refused: the unit went back, first in line; a leases it again
            assert q.held_by("a", keys[0]) is None and c.call("/lease", **a)["unit"]["index"] == 0
    assert q.give_back("a", [keys[0]]) == [keys[0]] and q.lease("b").key == keys[0]
    with pytest.raises(ServiceError) as err:
        c.call("/result", **b, key=keys[0], result=_result("bad"))
    assert err.value.code == 400 and "reward: 2 entries" in str(err.value)
    assert c.call("/lease", **a)["unit"]["index"] == 0
    assert c.call("/result", **a, key=keys[0], result={**_result("a"), "version": 0}) == {"verdict": "accepted"}
    with pytest.raises(ServiceError) as err:  # nobody leased unit 1 to b
        c.call("/result", **b, key=keys[1], result=_result("b"))
    assert err.value.code == 409
    assert q.complete("a", keys[1], _result("a")) == "not-leased"
    assert checked == [keys[0], keys[0]]  # only the leaseholder's results at the right version reach the check
    assert q.lease("segment:0").key == keys[1] and q.complete("segment:0", keys[1], _result("own")) == "accepted"
    got = q.collect(keys)
    assert got[0]["served_by"] == "a" and got[0]["checked"] and got[0]["version"] == 0


def test_every_malformed_body_gets_a_400_and_the_service_keeps_serving(service) -> None:
    q, server, _ = service
    url = f"http://127.0.0.1:{server.port}"
    sess = Client(url, "the-secret").call("/register", worker="w1")["session"]
    me = {"worker": "w1", "segment": "7-0", "session": sess}

    def post(path: str, body: bytes) -> int:
        req = urllib.request.Request(url + path, data=body, method="POST",
                                     headers={AUTH_HEADER: sign("the-secret", path, body)})
        try:
            with urllib.request.urlopen(req, timeout=10):
                return 200
        except urllib.error.HTTPError as e:
            assert "error" in json.loads(e.read())
            return e.code

    bodies = [b"not json", b"\xff\xfe", b"[]", b"null", b"42", b'"w1"', b"{}", b'{"worker": 7}', b'{"worker": ""}',
              b'{"worker": "segment:0"}', b'{"worker": "a\\nforged log line"}', json.dumps({"worker": "x" * 200}).encode(),
              b"[" * 8000 + b"]" * 8000, b'{"worker": ' + b"1" * 5000 + b"}"]
    assert {post("/register", b) for b in bodies} == {400}
    q.add(_units(n_prompts=1))
    for body in ({**me, "key": 5, "result": {}}, {**me, "key": "train:0:0", "result": []}, {**me, "key": "train:0:0"},
                 {**me, "give_back": "train:0:0"}, {**me, "give_back": [1]}):
        path = "/deregister" if "give_back" in body else "/result"
        assert post(path, json.dumps(body).encode()) == 400, body
    assert Client(url, "the-secret").call("/heartbeat", **me) == {}  # still serving, still registered


def test_a_lease_waits_for_a_unit_that_suits_the_worker(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A lease is a long poll: asked while nothing suits the worker, the one request returns the unit
    added while it waited, or the unit whose version was published while it waited (the segment's
    own workers get a unit the moment one exists; a worker that only asked again later lost every
    unit of a short rollout to them). The wait is made long so that no clock decides."""
    monkeypatch.setattr(unit_server, "LEASE_WAIT_S", 60.0)
    q = UnitQueue()
    published = {0}
    server = ElasticServer(Service(q, "7-0", {}, accept=lambda u: u.version in published), "the-secret",
                           "127.0.0.1").start()
    c = Client(f"http://127.0.0.1:{server.port}", "the-secret")

    def lease_while(make_it_suit) -> Unit:  # type: ignore[no-untyped-def]
        got: list[dict] = []
        asking = threading.Thread(target=lambda: got.append(c.call("/lease", **me)))
        asking.start()
        asking.join(0.3)
        assert asking.is_alive() and not got  # held open: nothing suits it yet
        make_it_suit()
        asking.join(30)
        assert not asking.is_alive() and "unit" in got[0], got
        return Unit.from_json(got[0]["unit"])

    try:
        me = {"worker": "w1", "segment": "7-0", "session": c.call("/register", worker="w1")["session"]}
        q.add(_units(rollout=1, n_prompts=1, version=1))  # waiting, but not for it: version 1 is not published
        assert lease_while(lambda: q.add(_units(n_prompts=1))).version == 0
        assert lease_while(lambda: (published.add(1), q.poke())).version == 1  # as unit_service publishes
    finally:
        server.close()


def test_many_clients_at_once_never_get_the_same_unit(service) -> None:
    q, server, _ = service
    keys = q.add(_units(n_prompts=40))
    got: list[str] = []
    lock = threading.Lock()

    def work(name: str) -> None:
        c = Client(f"http://127.0.0.1:{server.port}", "the-secret")
        sess = c.call("/register", worker=name)["session"]
        while True:
            out = c.call("/lease", worker=name, segment="7-0", session=sess)
            if "unit" not in out:
                return
            with lock:
                got.append(out["unit"]["index"])

    threads = [threading.Thread(target=work, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(got) == list(range(40)) and len(keys) == 40


def test_the_worker_program_refuses_a_directory_that_is_no_run_with_exit_2(tmp_path, capsys) -> None:
    from beam_hpc.backends.reference.rollouts.outside_worker import main

    assert main(["--run-dir", str(tmp_path / "nothing"), "--worker-id", "w"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("--run-dir: ") and "no plan.json" in err[0]
    (tmp_path / "plan.json").write_text("{}")
    assert main(["--run-dir", str(tmp_path), "--worker-id", "w", "--threads", "0"]) == 2
    assert capsys.readouterr().err.strip() == "--threads: 0; give 1 or more"
    assert main(["--run-dir", str(tmp_path), "--worker-id", "segment:0"]) == 2
    assert capsys.readouterr().err.strip().startswith("--worker-id: 'segment:0'; use letters, digits")


@pytest.mark.slow  # the tiny model's tokenizer (built once per machine, then cached)
def test_the_driver_recomputes_texts_and_rewards_and_checks_shapes_of_a_result(tmp_path, tiny_assets) -> None:
    """What ResultCheck keeps of an outside worker's result: the unit's own prompts, labels and
    version, the texts decoded and the rewards scored by the driver from the tokens (a reward the
    worker made up is replaced), and only well-shaped tokens and log-probs."""
    from job_plans import HOST_SITE, make_test_plan
    from reference_harness import SMALL

    from beam_hpc.backends.reference.rollouts.unit_service import ResultCheck

    recipe = make_test_plan(tmp_path / "run", assets=tiny_assets, site=HOST_SITE, overrides=SMALL).recipe
    check = ResultCheck.for_model(recipe, str(tiny_assets.model_dir))
    unit = cut("train", 3, [[5, 6, 7]], ["7"], samples_per_prompt=2, train=True, version=4, unit_prompts=1)[0]
    right, wrong = check.tok.encode("so \\boxed{7}"), check.tok.encode("so \\boxed{8}")
    sent = {"prompt_ids": [[1]] * 2, "response_ids": [right, wrong], "response_text": ["lie", "lie"], "label": ["x", "x"],
            "old_logp": [[-0.1] * len(right), [-0.2] * len(wrong)], "reward": [-1.0, 1.0], "correct": [False, True],
            "pred": ["?", "?"], "penalty": [0.0, 0.0], "version": 4, "generate_time_s": 0.5, "extra": [1, 2]}
    got = check(unit, sent)
    assert got["reward"] == [1.0, -1.0] and got["correct"] == [True, False] and got["pred"] == ["7", "8"]
    assert got["response_text"] == [check.tok.decode(right), check.tok.decode(wrong)] and "extra" not in got
    assert got["prompt_ids"] == [[5, 6, 7]] * 2 and got["label"] == ["7", "7"] and got["version"] == 4
    too_long = [1] * (recipe.tokens.max_response + 1)
    for bad, why in (({"response_ids": [right]}, "response_ids: 1 entries; unit train:3:0 has 2 samples"),
                     ({"response_ids": [right, too_long]}, "at most"),
                     ({"response_ids": [right, [check.vocab_size]]}, "a token id outside"),
                     ({"response_ids": [right, [True]]}, "a token id outside"),
                     ({"old_logp": [[-0.1] * len(right), [0.5] * len(wrong)]}, "old_logp\\[1\\]"),
                     ({"old_logp": [[-0.1] * len(right)]}, "old_logp: 1 entries")):
        with pytest.raises(unit_server.ResultRefused, match=why):
            check(unit, {**sent, **bad})
    evaluation = cut("eval", 3, [[5]], ["7"], samples_per_prompt=1, train=False, version=4, unit_prompts=1)[0]
    with pytest.raises(unit_server.ResultRefused, match="an evaluation unit has none"):
        check(evaluation, {**sent, "response_ids": [right]})
    assert check(evaluation, {**sent, "response_ids": [right], "old_logp": []})["reward"] == [1.0]
