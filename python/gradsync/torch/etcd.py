"""An etcd cluster as an elastic job's store: :class:`EtcdStore`.

gradsync's supervisor hosts a ``TCPStore`` by default; where a site runs
etcd (Debian's ``etcd-server``, the store torch's and Paddle's elastic
rendezvous also speak), the job can keep its membership there instead, so
that no process of the job, the supervisors included, holds state the others
need::

    python -m gradsync.launch --store etcd://10.0.0.5:2379 --nproc 8 train.py

The job's records go through etcd's v3 API (its JSON gateway over plain
HTTP, spoken by gradsync's Rust core, ``gradsync._native.EtcdClient``): the
membership protocol, heartbeats and obituaries use the client directly, off
the interpreter; :class:`EtcdStore` gives the same keys to Python as a
``torch.distributed.Store`` (``elastic.store``). torch's process groups
cannot rendezvous on a store written in Python (they clone their store, and
torch cannot clone a Python one), so each membership epoch's first member
hosts a ``TCPStore`` for that epoch's groups and publishes its address in
etcd; if that process is lost, so is the epoch, and the next epoch's first
member hosts the next one. No store outlives the job's state but etcd.
"""

import datetime
import time

import torch.distributed as dist

from gradsync._errors import ConfigError
from gradsync._native import EtcdClient

#: The scheme of an etcd address in ``GRADSYNC_STORE`` and ``--store``.
SCHEME = "etcd://"


def is_etcd(address):
    """Whether a store address names etcd (``etcd://host:port[,host:port]``)."""
    return address.startswith(SCHEME)


class EtcdStore(dist.Store):
    """A ``torch.distributed.Store`` on an etcd cluster: ``endpoints``
    (``host:port``, comma-separated, ``etcd://`` optional), every key under
    ``prefix``. ``get`` and ``wait`` wait up to ``timeout`` for their keys,
    as c10d's stores do."""

    def __init__(self, endpoints, prefix="gradsync", timeout=datetime.timedelta(seconds=300)):
        super().__init__()
        if isinstance(timeout, (int, float)):
            timeout = datetime.timedelta(seconds=timeout)
        self._timeout = timeout
        #: Where this store's keys live in etcd.
        self.prefix = prefix
        #: The Rust client (the membership protocol uses it directly).
        self.client = EtcdClient(endpoints, prefix, timeout_s=min(timeout.total_seconds(), 30.0))

    @staticmethod
    def _bytes(value):
        if isinstance(value, str):
            return value.encode()
        if isinstance(value, (bytes, bytearray, memoryview)):
            return bytes(value)
        raise ConfigError(f"a store value must be str or bytes, not {type(value).__name__}")

    def set(self, key, value):
        """Set ``key`` to ``value``."""
        self.client.set(key, self._bytes(value))

    def get(self, key):
        """The value at ``key``, waiting for it up to the store's timeout."""
        self.wait([key])
        value = self.client.get(key)
        if value is None:  # deleted between the wait and the read
            raise dist.DistStoreError(f"etcd store: key {key!r} disappeared while being read")
        return value

    def add(self, key, amount):
        """Add ``amount`` to the integer at ``key``; the new value."""
        return self.client.add(key, int(amount))

    def compare_set(self, key, expected_value, desired_value):
        """Set ``key`` to ``desired_value`` if it holds ``expected_value``
        (empty: absent); what it holds afterwards."""
        return self.client.compare_set(key, self._bytes(expected_value), self._bytes(desired_value))

    def wait(self, keys, override_timeout=None):
        """Wait until every key in ``keys`` exists (c10d's ``DistStoreError`` after the timeout)."""
        timeout = override_timeout if override_timeout is not None else self._timeout
        began = time.monotonic()
        if not self.client.wait(list(keys), timeout.total_seconds()):
            raise dist.DistStoreError(
                f"etcd store: keys {list(keys)} did not appear within {time.monotonic() - began:.1f} s "
                f"(the peers that set them may be gone)")

    def check(self, keys):
        """Whether every key in ``keys`` exists (never waits)."""
        return all(self.client.get(k) is not None for k in keys)

    def delete_key(self, key):
        """Delete ``key``; whether it was there."""
        return self.client.delete(key)

    def num_keys(self):
        """How many keys the store holds under its prefix."""
        return self.client.count()

    def set_timeout(self, timeout):
        """How long ``get`` and ``wait`` wait from now on."""
        self._timeout = timeout

    @property
    def timeout(self):
        """How long ``get`` and ``wait`` wait."""
        return self._timeout
