"""gradsync.torch.etcd.EtcdStore: an etcd cluster as an elastic job's
store (c10d's semantics for the job's own keys; the membership protocol
runs on its Rust client), against a real etcd server on loopback. A whole
elastic job over etcd: test_elastic.py."""

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from gradsync._errors import MembershipError
from gradsync._native import EtcdClient
from gradsync.torch.etcd import EtcdStore


def test_the_store_keeps_c10d_semantics(etcd_server):
    store = EtcdStore(f"etcd://{etcd_server}", prefix="job", timeout=2)
    store.set("k", "v")
    assert store.get("k") == b"v"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.compare_set("c", b"", b"first") == b"first"
    assert store.compare_set("c", b"", b"second") == b"first", "only the first writer wins"
    assert store.check(["k", "n"]) and not store.check(["k", "absent"])
    assert store.num_keys() == 3
    assert store.delete_key("k") and not store.delete_key("k")
    assert EtcdStore(etcd_server, prefix="other-job", timeout=2).num_keys() == 0, "prefixes keep jobs apart"


def test_get_waits_for_the_key_and_names_it_when_it_never_comes(etcd_server):
    store = EtcdStore(etcd_server, prefix="job", timeout=5)
    threading.Timer(0.3, lambda: EtcdStore(etcd_server, prefix="job").set("late", b"x")).start()
    began = time.monotonic()
    assert store.get("late") == b"x" and time.monotonic() - began >= 0.25
    with pytest.raises(dist.DistStoreError, match="never-set"):
        store.wait(["never-set"], datetime.timedelta(seconds=0.3))


def test_an_unreachable_cluster_is_a_clear_error():
    with pytest.raises(MembershipError, match="no etcd endpoint answered.*127.0.0.1:9"):
        EtcdClient("127.0.0.1:9", "job", timeout_s=1.0)
    with pytest.raises(MembershipError, match="only plain-HTTP"):
        EtcdClient("https://127.0.0.1:2379", "job")
