"""The multi-host harness itself (issue 19): hosts in network namespaces
reach each other and the test over private addresses; a link set down cuts
exactly that host off, and setting it up restores it; everything is gone
after. The multi-host PD tests build on this."""

import socket
import subprocess
import sys
import time

from netns import Topology

SERVE_ONE = ("import socket,sys;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,"
             "socket.SO_REUSEADDR,1);s.bind((sys.argv[1],7777));s.listen();"
             "c,_=s.accept();c.sendall(sys.argv[1].encode());c.close()")


def reach(addr, timeout=2.0):
    try:
        with socket.create_connection((addr, 7777), timeout=timeout) as s:
            s.settimeout(timeout)
            return s.recv(64).decode()
    except OSError:
        return None


def serve_once(t, host):
    return t.popen(host, [sys.executable, "-c", SERVE_ONE, t.addr[host]])


def test_hosts_reach_each_other_and_a_downed_link_cuts_one_off():
    with Topology(["a", "b"]) as t:
        srv = serve_once(t, "b")
        try:
            # From the test's namespace, and from host a.
            got = None
            for _ in range(50):
                got = reach(t.addr["b"], timeout=0.5)
                if got:
                    break
                time.sleep(0.1)
            assert got == t.addr["b"]
            srv.wait(timeout=10)
            srv = serve_once(t, "b")
            r = t.run("a", [sys.executable, "-c",
                            f"import socket,time\nfor _ in range(50):\n"
                            f"  try:\n    s=socket.create_connection(('{t.addr['b']}',7777),1);"
                            f"print(s.recv(64).decode());break\n"
                            f"  except OSError: time.sleep(0.1)"])
            assert r.stdout.strip() == t.addr["b"], r.stderr
            srv.wait(timeout=10)
            # b's cable pulled: nothing reaches it; plugged back: it does.
            srv = serve_once(t, "b")
            t.link_down("b")
            assert reach(t.addr["b"], timeout=1.0) is None
            t.link_up("b")
            got = None
            for _ in range(50):
                got = reach(t.addr["b"], timeout=0.5)
                if got:
                    break
                time.sleep(0.1)
            assert got == t.addr["b"]
        finally:
            srv.kill()
            srv.wait(timeout=10)
        names = [t.ns("a"), t.ns("b"), t.switch]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names), listed
