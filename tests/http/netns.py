"""Hosts for multi-host tests (issue 19): one network namespace per host,
each joined by a veth pair to a bridge in a namespace of its own (the
"switch"), private addresses 10.<net>.0.<n>/24 inside them only, and one
more veth from the test's own namespace to the switch so the test can
reach every host. Nothing outside the namespaces this module creates is
ever addressed.

Faults: `link_down(host)` / `link_up(host)` set a host's switch-side veth
down or up (a cable pulled mid-transfer; a partition is every link of a
side down). Everything is removed on exit, also after a failure.

Needs root and `ip` (iproute2); a test that cannot make namespaces fails —
it does not skip.
"""

import os
import shutil
import subprocess
from pathlib import Path
from contextlib import contextmanager


def ip(*args, ns=None, check=True):
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return r


class Topology:
    """`hosts` names; host i gets 10.<net>.0.<i + 10>; the test side
    10.<net>.0.1. Use as a context manager."""

    def __init__(self, hosts, net=None):
        self.tag = f"iso{os.getpid() % 100000}"
        # A /24 per test process, inside 10.64.0.0/10 (never routed here).
        self.net = net if net is not None else 64 + os.getpid() % 60
        self.hosts = list(hosts)
        self.switch = f"{self.tag}-sw"
        self.addr = {h: f"10.{self.net}.0.{i + 10}" for i, h in enumerate(self.hosts)}
        self.test_addr = f"10.{self.net}.0.1"
        self._made = []

    def ns(self, host):
        return f"{self.tag}-{host}"

    def _port(self, host):
        # Interface names are at most 15 bytes.
        return f"{self.tag[:8]}{self.hosts.index(host)}s"

    def __enter__(self):
        try:
            ip("netns", "add", self.switch)
            self._made.append(("netns", self.switch))
            ip("link", "add", "br0", "type", "bridge", ns=self.switch)
            ip("link", "set", "br0", "up", ns=self.switch)
            for h in self.hosts:
                ns = self.ns(h)
                ip("netns", "add", ns)
                self._made.append(("netns", ns))
                ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name",
                   self._port(h), "netns", self.switch)
                ip("link", "set", self._port(h), "master", "br0", ns=self.switch)
                ip("link", "set", self._port(h), "up", ns=self.switch)
                ip("addr", "add", f"{self.addr[h]}/24", "dev", "eth0", ns=ns)
                ip("link", "set", "eth0", "up", ns=ns)
                ip("link", "set", "lo", "up", ns=ns)
            # The test's own way in.
            host_if = f"{self.tag[:8]}t"
            ip("link", "add", host_if, "type", "veth", "peer", "name", "tport",
               "netns", self.switch)
            self._made.append(("link", host_if))
            ip("link", "set", "tport", "master", "br0", ns=self.switch)
            ip("link", "set", "tport", "up", ns=self.switch)
            ip("addr", "add", f"{self.test_addr}/24", "dev", host_if)
            ip("link", "set", host_if, "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        for kind, name in reversed(self._made):
            if kind == "netns":
                ip("netns", "del", name, check=False)
            elif kind == "etc":
                shutil.rmtree(name, ignore_errors=True)
            else:
                ip("link", "del", name, check=False)
        self._made.clear()

    def names(self, host, names):
        """What `host` resolves: `names` maps a name to its addresses (a name
        with several is what a Kubernetes headless Service looks like).
        `ip netns exec` bind-mounts `/etc/netns/<ns>/hosts` over /etc/hosts
        for what it starts, and glibc reads the file on every lookup, so
        calling this again while processes run changes what they resolve.
        The file is rewritten in place (a new inode would not be seen
        through the bind mount). Lookups use the file only
        (`nsswitch.conf`: `hosts: files`), so no DNS server is ever asked.
        Call it before starting the host's processes."""
        d = Path("/etc/netns") / self.ns(host)
        if not d.exists():
            d.mkdir(parents=True)
            self._made.append(("etc", str(d)))
            (d / "nsswitch.conf").write_text("hosts: files\n")
        lines = ["127.0.0.1 localhost"] + [f"{a} {n}" for n, addrs in names.items() for a in addrs]
        with open(d / "hosts", "r+" if (d / "hosts").exists() else "w") as f:
            f.seek(0)
            f.truncate()
            f.write("\n".join(lines) + "\n")

    def popen(self, host, cmd, **kw):
        """`cmd` run inside `host`'s namespace."""
        return subprocess.Popen(["ip", "netns", "exec", self.ns(host), *cmd], **kw)

    def run(self, host, cmd, timeout=30):
        return subprocess.run(["ip", "netns", "exec", self.ns(host), *cmd],
                              capture_output=True, text=True, timeout=timeout)

    def link_down(self, host):
        ip("link", "set", self._port(host), "down", ns=self.switch)

    def link_up(self, host):
        ip("link", "set", self._port(host), "up", ns=self.switch)


@contextmanager
def topology(hosts):
    with Topology(hosts) as t:
        yield t
