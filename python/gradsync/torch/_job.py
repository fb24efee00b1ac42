"""An elastic job's surroundings: the variables gradsync's supervisor sets
for its workers, the exit statuses it reads back, and a worker's
connections (the job's store, for the process groups, the membership
protocol and the liveness monitor; the address its peers probe it at).
``gradsync.torch.elastic`` builds on it; ``gradsync.launch`` sets what it
reads."""

import datetime
import fcntl
import os
import socket
import struct

import torch.distributed as dist

from gradsync._errors import ConfigError, MembershipError
from gradsync._native import EtcdClient
from gradsync.torch.etcd import EtcdStore, is_etcd

#: The launcher's variables (set by ``python -m gradsync.launch``).
ENV_STORE, ENV_JOB, ENV_MEMBER, ENV_FIRST, ENV_JOIN = (
    "GRADSYNC_STORE", "GRADSYNC_JOB", "GRADSYNC_MEMBER", "GRADSYNC_FIRST", "GRADSYNC_JOIN",
)
#: The address this process's peers reach it at (the supervisor's ``--host``):
#: with etcd, each epoch's first member hosts that epoch's rendezvous there.
ENV_HOST = "GRADSYNC_HOST"
#: This process's node (its supervisor's ``--node-rank``), and how many nodes
#: the job's first members ran on (``--nnodes``; they are laid out node by
#: node, the same number on each). A sharded job keeps each partition's
#: buddy copy on another node.
ENV_NODE, ENV_NODES = "GRADSYNC_NODE", "GRADSYNC_NODES"
#: The exit status of a worker that left the job (the others went on without
#: it): the supervisor does not count it as a failure.
EXIT_LEFT = 3
#: The exit status of a joiner the members refused (another model or
#: optimizer, or collectives that differed from theirs): not a failure either.
EXIT_REFUSED = 4


def exit_status(error):
    """The exit status for a worker ending with ``error`` (a
    :class:`gradsync.MembershipError`), as the supervisor reads it:
    :data:`EXIT_REFUSED` for a refused joiner, :data:`EXIT_LEFT` for a
    process the job went on without, 1 for anything else (no quorum, the
    store lost, a job with no member left)::

        except gradsync.MembershipError as e:
            sys.exit(gradsync.torch.elastic.exit_status(e))
    """
    kind = getattr(error, "kind", None)
    if kind == "refused":
        return EXIT_REFUSED
    return EXIT_LEFT if kind == "left_out" else 1


# Linux's ioctl for an interface's IPv4 address.
_SIOCGIFADDR = 0x8915


def env(name, convert=str):
    value = os.environ.get(name)
    if value is None:
        raise ConfigError(
            f"{name} is not set: an elastic job runs under gradsync's supervisor "
            "(python -m gradsync.launch --nproc N script.py), which hosts its store and sets it"
        )
    try:
        return convert(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is malformed; start the job with python -m gradsync.launch") from None


def probe_host(address):
    """Where this process's peers probe it: the address of the interface
    gloo uses (``GLOO_SOCKET_IFNAME``, its first name), so a probe takes the
    path the collectives take; else the address this machine reaches the
    job's store from (the store's ``host:port``, or etcd's first endpoint);
    the supervisor's ``--host`` when neither can be read."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if interface:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                request = struct.pack("256s", interface[:15].encode())
                return socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)[20:24])
        except OSError:
            pass
    first = address.removeprefix("etcd://").split(",")[0]
    host, _, port = first.rpartition(":")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, int(port)))  # (a datagram socket sends nothing to connect)
            return s.getsockname()[0]
    except (OSError, ValueError):
        return os.environ.get(ENV_HOST, "127.0.0.1")


def first_nodes(first_world):
    """The node of each of the job's first members (``ENV_NODES`` nodes
    holding the same number of them, node by node)."""
    nodes = env(ENV_NODES, int) if ENV_NODES in os.environ else 1
    if nodes < 1 or first_world % nodes:
        raise ConfigError(f"{ENV_NODES}={nodes} does not divide the job's {first_world} first members; "
                          "start the job with python -m gradsync.launch")
    return [m // (first_world // nodes) for m in range(first_world)]


#: How long connecting to the job's TCPStore may take: a thousand workers
#: connecting at once queue at its one server thread for seconds, far longer
#: than a heartbeat's call may take once connected.
CONNECT_S = 120.0


def tcp_store(host, port, timeout_s):
    """A client of the TCPStore at ``host:port`` whose calls time out after
    ``timeout_s``; connecting may take up to :data:`CONNECT_S` whatever that is."""
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=max(timeout_s, CONNECT_S)))
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


def connect(shim, address, timeout, liveness_s):
    """The job's store at ``address`` (``host:port`` of the supervisor's
    ``TCPStore``, or ``etcd://host:port[,...]``): a torch store for the
    process groups, and the membership's two clients (the protocol's, and
    the liveness monitor's own, so a blocking call never delays a heartbeat)."""
    try:
        if is_etcd(address):
            store = EtcdStore(address, timeout=timeout)
            return store, store.client, EtcdClient(address, store.prefix, timeout_s=max(2.0, 2 * liveness_s))
        host, _, port = address.rpartition(":")
        store = tcp_store(host, int(port), timeout)
        beat_store = tcp_store(host, int(port), max(2.0, 2 * liveness_s))
        return store, shim.StoreClient(store), shim.StoreClient(beat_store)
    except (RuntimeError, ValueError, MembershipError) as e:
        raise MembershipError.of(
            "store", f"cannot reach the job's store at {address} ({e}); is the supervisor (or etcd) running?"
        ) from None
