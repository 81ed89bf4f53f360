"""What a node says about itself before a run: run with the node's python, its source sent on
standard input in a bundle (backends/shipping.py), so that nothing has to be copied there first.

Standard library only, Python 3.8+, because it runs on whatever interpreter the node has.

    probe.py facts --dir D [--workdir W] [--own ADDR --master ADDR] [--ifname IF]
                   [--port P] [--connect ADDR:PORT [--connect-on-word]]
                   [--container-runtime R --container-image I]
                   [--script PATH] [--deep] [--health [--health-dir PATH]]
        JSON: python, torch (found without importing it), the run directory (made, 0700),
        the GPUs the NVIDIA driver has and CUDA_VISIBLE_DEVICES,
        the network interface that reaches the master, InfiniBand devices, whether the master
        port is free; --script whether PATH, from the workdir, is a file there (the job's
        script, before anything starts); --connect whether a TCP connection to the master port opens (the
        listener below is there meanwhile; with --connect-on-word, once the launcher's line
        says it listens: the probe starts meanwhile, not after it); the container runtime's version and the image's id
        on this node; --deep adds what importing torch and nvidia-smi tell (CUDA, cuDNN, NCCL,
        driver, GPUs and their use), /dev/shm, free disk, open-file limit, and for an image that
        is not here whether its registry has it; --health what health.py reports (the GPUs'
        faults, their foreign processes, Xid lines, free disk of the workdir and of
        --health-dir, free memory). Then it returns None: in a launch's check,
        the launcher's next bundle on the same input is this node's start (the stage).
    probe.py listen --port P [--seconds S]
        Listen on P (as torchrun's store will), answer {"listening": true}, accept and close every
        connection until standard input closes or S seconds pass.
    probe.py connect --addr A --port P [--timeout T]
        JSON: whether a TCP connection to A:P opens within T seconds.
"""
import errno
import os
import select
import sys

# socket.py's C half: the module itself (its enums, built at import, and selectors) costs every
# node ~3 ms of CPU, for what these calls take as it is. The master's listener, rare, uses it.
import _socket
import time

import containers  # noqa: E402  (loaded before this module by the bootloader)
import health  # noqa: E402
import options  # noqa: E402
import torchfind  # noqa: E402


def main(argv):
    args = parse(argv)
    if args.cmd == "facts":
        options.answer(facts(args))
        return None      # the launcher's next bundle, if any, is this node's start (the stage)
    if args.cmd == "listen":
        return listen(args.port, args.seconds)
    if args.cmd == "connect":
        options.answer(connect(args.addr, args.port, args.timeout))
        return 0
    if args.cmd == "forget":
        forget(args.dir)
        return 0
    return 2


# Each command's options (the module's docstring says what they mean): name -> default or type.
COMMANDS = {
    "facts": ({"dir": str, "workdir": str, "own": str, "master": str, "ifname": str, "port": int,
               "container-runtime": str, "container-image": str, "script": str, "connect": str,
               "connect-timeout": 8.0, "listen": int, "listen-seconds": 60.0,
               "health-dir": str},
              ("deep", "connect-on-word", "health"), ()),
    "listen": ({"port": int, "seconds": 60.0}, (), ("port",)),
    "connect": ({"addr": str, "port": int, "timeout": 8.0}, (), ("addr", "port")),
    "forget": ({"dir": str}, (), ("dir",)),
}


def parse(argv):
    cmd = argv[0] if argv else None
    if cmd not in COMMANDS:
        raise SystemExit("probe.py: the first word is one of %s" % ", ".join(COMMANDS))
    opts, flags, required = COMMANDS[cmd]
    args = options.parse("probe.py " + cmd, argv[1:], opts, flags, required=required)
    args.cmd = cmd
    return args


# --- facts -----------------------------------------------------------------------------------

def facts(args):
    started = time.time()     # with "time" at the end: the launcher's clock estimate leaves out our work
    if args.listen:           # first, so that every node's connect may go at once
        options.answer(start_listening(args.listen, args.listen_seconds))
    out = {"home": os.path.expanduser("~"), "python": sys.version.split()[0],
           "executable": sys.executable, "hostname": _socket.gethostname(),
           "torch": torchfind.torch_facts()}
    for key, d in (("workdir", args.workdir), ("dir", args.dir)):
        if d:
            out[key] = make_dir(d, private=key == "dir")
    if args.master:
        out["network"] = network(args.own or _socket.gethostname(), args.master, args.ifname)
    out["ib_devices"] = sorted(os.listdir("/sys/class/infiniband")) \
        if os.path.isdir("/sys/class/infiniband") else []
    out["nvidia_gpus"] = health.nvidia_gpus()
    out["cuda_visible"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    if args.port:
        out["port_free"] = port_free(args.port)
    if args.connect and (not args.connect_on_word or word() == "connect"):
        addr, _, port = args.connect.rpartition(":")
        out["reach"] = connect(addr, int(port), args.connect_timeout)
    if args.script:    # after the word: the launcher's sync of this node comes before it
        out["script"] = script_facts(args.workdir or ".", args.script)
    if args.container_runtime:
        out["container"] = containers.container_facts(args.container_runtime,
                                                      args.container_image, args.deep)
    if args.health:     # one --health-dir: a comma-separated list could not hold every path
        extra = [args.health_dir] if args.health_dir else []
        out["health"] = health.health_facts(args.workdir or ".", extra)
    if args.deep:
        nvidia = out["health"]["nvidia"] if args.health else health.nvidia_facts()
        out.update(deep_facts(out.get("workdir") or out.get("dir") or ".", nvidia))
    out["time_start"], out["time"] = started, time.time()
    return out


def word():
    """One line of the input, read to its end and no further (what follows is the next
    bundle, for the bootloader); '' when the input ended."""
    line = b""
    while not line.endswith(b"\n"):
        c = os.read(0, 1)
        if not c:
            break
        line += c
    return line.decode(errors="replace").strip()


def make_dir(d, private):
    path = os.path.abspath(os.path.expanduser(d))
    try:
        os.makedirs(path, exist_ok=True)
        if private:
            for folder in private_folders(path):
                if os.stat(folder).st_uid == os.getuid():     # a shared .cluster stays as it is
                    os.chmod(folder, 0o700)
    except OSError as exc:
        return {"error": "cannot create %s: %s" % (path, exc.strerror)}
    return path


def forget(d):
    """A launch that failed its check leaves this node: the run folder its check made goes,
    and the run's folder above it when that is empty then. Empty folders only (rmdir): what
    anything put there stays."""
    folder = os.path.abspath(os.path.expanduser(d))
    for empty in (folder, os.path.dirname(folder)):
        try:
            os.rmdir(empty)
        except OSError:
            return


def script_facts(workdir, script):
    """Where the job's script is from the workdir (where the node's script starts torchrun),
    and whether a file is there."""
    path = os.path.join(os.path.abspath(os.path.expanduser(workdir)), script)
    return {"path": path, "file": os.path.isfile(path)}


def private_folders(path):
    """The run's folder and those above it up to the workdir's .cluster (makedirs leaves the
    ones it made on the way at the umask's mode): <workdir>/.cluster/<run>/<node>."""
    parts = path.split(os.sep)
    if ".cluster" not in parts:
        return [path]
    top = len(parts) - 1 - parts[::-1].index(".cluster")
    return [os.sep.join(parts[:i + 1]) or os.sep for i in range(top, len(parts))]


def port_free(port):
    """Whether torchrun's rendezvous store could listen on port: it binds every address with
    SO_REUSEADDR, so a port whose last connections sit in TIME_WAIT is free. Only a listener
    that holds the port (EADDRINUSE), or a port this user may not bind (EACCES), is busy."""
    s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
    try:
        s.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
        s.bind(("", port))
        s.listen(1)
        return True
    except OSError as exc:
        return exc.errno not in (errno.EADDRINUSE, errno.EACCES)
    finally:
        s.close()


# --- the network interface ---------------------------------------------------------------------

def ipv4(name):
    try:
        return _socket.getaddrinfo(host(name), None, _socket.AF_INET)[0][4][0]
    except (_socket.gaierror, IndexError, UnicodeError):
        return None


def host(name):
    """name for getaddrinfo: bytes when it is ASCII (as nearly every one is), which the
    kernel's resolver takes as they are. A str is always encoded with the idna codec first,
    whose import (with stringprep) costs every node of a launch 1-2 ms of CPU."""
    try:
        return name.encode("ascii")
    except UnicodeError:
        return name


def primary_addresses():
    """Interface name -> its primary IPv4 address, asked of the kernel directly (no `ip`
    process: on a launch of hundreds of nodes every fork counts)."""
    import fcntl
    import struct
    found = {}
    s = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
    try:
        for _, name in _socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue                  # no IPv4 address
            found[name] = [_socket.inet_ntoa(raw[20:24])]
    except OSError:
        return {}
    finally:
        s.close()
    return found


def interface_addresses(wanted=()):
    """Interface name -> its IPv4 addresses: the primary ones from the kernel, and, when an
    address we look for is not among them, every one from `ip -o -4 addr` (secondary too)."""
    found = primary_addresses()
    have = {ip for ips in found.values() for ip in ips}
    if found and all(w in have for w in wanted if w):
        return found
    import subprocess        # here, not above: rare (the supervisor starts its job without it)
    found = {}
    try:
        out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "inet":
            found.setdefault(parts[1].split("@")[0], []).append(parts[3].split("/")[0])
    return found


def source_address(ip):
    """The local address the kernel would send from to reach ip (a UDP connect sends nothing)."""
    s = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
    try:
        s.connect((ip, 9))
        return s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()


def link_state(name):
    try:
        with open("/sys/class/net/%s/operstate" % name) as f:
            state = f.read().strip()
    except OSError:
        return None
    return state


def network(own, master, manual):
    """The interface this node's NCCL and Gloo should use, and whether it reaches the master.
    Chosen by address, never by name: the one holding the address the other nodes reach this
    node by, else the one the route to the master leaves through (not docker0, not a VPN)."""
    own_ip, master_ip = ipv4(own), ipv4(master)
    source = source_address(master_ip) if master_ip else None
    addrs = interface_addresses((own_ip, source))
    owner = {ip: name for name, ips in addrs.items() for ip in ips}
    out = {"own_ip": own_ip, "master_ip": master_ip, "interfaces": sorted(addrs)}
    route = owner.get(source) if source else None
    out["route_to_master"] = route
    if manual:
        out["ifname"], out["how"] = manual, "set in the inventory"
        missing = [n for n in manual_names(manual) if link_state(n) is None]
        if missing:
            out["error"] = "interface %s does not exist here (it has: %s)" % (
                ", ".join(missing), ", ".join(sorted(addrs)) or "none")
        return out
    chosen, how = None, ""
    if own_ip and owner.get(own_ip) and (owner[own_ip] != "lo" or (master_ip or "").startswith("127.")):
        chosen, how = owner[own_ip], "holds this node's address %s" % own_ip
    elif route:
        chosen, how = route, "carries the route to the master %s" % master_ip
    if not chosen:
        out["error"] = ("no interface holds %s and none routes to the master %s"
                        % (own_ip or own, master_ip or master))
        return out
    out.update(ifname=chosen, how=how, state=link_state(chosen))
    if out["state"] == "down":
        out["error"] = "interface %s is down" % chosen
    elif route and master_ip and not master_ip.startswith("127.") and route not in (chosen, "lo"):
        out["warning"] = "the route to the master leaves through %s, not %s" % (route, chosen)
    return out


def manual_names(spec):
    """The exact interface names an NCCL_SOCKET_IFNAME value insists on: '=eth0,ib0' names
    them; a plain name must exist; '^docker0' (exclude) and prefixes name none for sure."""
    if spec.startswith("^"):
        return []
    exact = spec.startswith("=")
    names = [n for n in spec.lstrip("=").split(",") if n]
    if exact or len(names) == 1:
        return names
    return []


# --- deep facts (cluster doctor) -----------------------------------------------------------------

def deep_facts(workdir, nvidia):
    out = {"gpus": health.deep_gpus(nvidia), "shm_bytes": None, "disk_free_bytes": None,
           "nofile": None}
    for key, path in (("shm_bytes", "/dev/shm"), ("disk_free_bytes", workdir)):
        try:
            st = os.statvfs(path)
            out[key] = st.f_bavail * st.f_frsize if key == "disk_free_bytes" else st.f_blocks * st.f_frsize
        except OSError:
            pass
    try:
        import resource
        out["nofile"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, ValueError, OSError):
        pass
    out["torch_runtime"] = torch_runtime()
    return out


def torch_runtime():
    """What only importing torch tells: CUDA as built, cuDNN, NCCL, devices it sees."""
    torchfind.run_site()      # the job's torch, found as the job finds it
    try:
        import torch
    except Exception as exc:  # a broken install is a finding, not a crash
        return {"error": "%s: %s" % (type(exc).__name__, exc)}
    info = {"version": getattr(torch, "__version__", None), "cuda": None, "cudnn": None,
            "nccl": None, "cuda_available": False, "device_count": 0}
    try:
        info["cuda"] = torch.version.cuda
        info["cudnn"] = torch.backends.cudnn.version()
        info["cuda_available"] = bool(torch.cuda.is_available())
        info["device_count"] = torch.cuda.device_count() if info["cuda_available"] else 0
        if info["cuda_available"]:
            nccl = torch.cuda.nccl.version()
            info["nccl"] = ".".join(str(x) for x in nccl) if isinstance(nccl, tuple) else str(nccl)
    except Exception as exc:
        info["error"] = "%s: %s" % (type(exc).__name__, exc)
    return info


# --- reachability ------------------------------------------------------------------------------

def listen(port, seconds):
    """The `listen` command: answer {"listening": true} (or false, with the error), accept until
    the input ends or seconds pass."""
    said = start_listening(port, seconds)
    options.answer(said)
    if not said["listening"]:
        return 1
    deadline = time.time() + seconds
    while time.time() < deadline:
        if select.select([0], [], [], max(0.0, deadline - time.time()))[0] and not os.read(0, 4096):
            break                          # the launcher is done checking
    handover()
    return 0


# The master port's listener of a launch's check, in the master's own probe: open from the
# probe's first moment until the next bundle (this node's start: the port is torchrun's then).
LISTENING: "list[tuple]" = []      # (a string: not evaluated, Python 3.8 too)


def start_listening(port, seconds):
    """Listen on port (as torchrun's store will) and accept and close every connection, in a
    thread, until handover() or `seconds` pass. {"listening": true}, or false with why."""
    import socket            # its accept(): the master's only
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        srv.bind(("", port))
        srv.listen(4096)                   # every node at once: the kernel caps it at somaxconn
    except OSError as exc:
        srv.close()
        return {"listening": False, "error": "cannot listen on port %d: %s" % (port, exc.strerror)}
    import threading
    wake_r, wake_w = os.pipe()
    accepting = threading.Thread(target=accept_all, args=(srv, wake_r, time.time() + seconds),
                                 daemon=True)
    accepting.start()
    LISTENING.append((srv, wake_r, wake_w, accepting))
    return {"listening": True}


def accept_all(srv, wake, deadline):
    while True:
        left = deadline - time.time()
        ready = select.select([srv, wake], [], [], max(0.0, left))[0] if left > 0 else [wake]
        if wake in ready:
            return
        try:
            conn, _ = srv.accept()
            conn.close()
        except OSError:
            pass


def handover():
    """The bootloader's call as the next bundle comes: the listener ends, its port free
    before this returns (its thread gone first: a socket another thread still waits on would
    stay open after close)."""
    while LISTENING:
        srv, wake_r, wake_w, accepting = LISTENING.pop()
        os.write(wake_w, b"x")
        accepting.join(5)
        srv.close()
        os.close(wake_r)
        os.close(wake_w)


# Worth another try within the budget: a moment of congestion (a lost SYN or ARP answer) looks
# like these. A refusal is final: something answered and said no.
TRANSIENT = (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT, errno.EAGAIN)


def connect(addr, port, timeout):
    """Open a TCP connection to addr:port, trying again after a transient failure until
    `timeout` seconds have passed in all."""
    t0 = time.time()
    tries, why = 0, ""
    while True:
        left = timeout - (time.time() - t0)
        tries += 1
        try:
            open_close(addr, port, max(0.1, min(left, 3.0)))
            return {"ok": True, "seconds": time.time() - t0, "tries": tries}
        except _socket.timeout:
            why = "no answer within %g s (a firewall dropping packets?)" % timeout
        except OSError as exc:
            why = exc.strerror or str(exc)
            if exc.errno not in TRANSIENT:
                break
        if time.time() - t0 + 0.5 >= timeout:
            break
        time.sleep(0.5)
    return {"ok": False, "seconds": time.time() - t0, "tries": tries, "error": why}


def open_close(addr, port, timeout):
    """A TCP connection to addr:port opened and closed, as socket.create_connection opens it:
    each address of the name in turn; the last one's error when none opens."""
    err = OSError("getaddrinfo returns an empty list")
    for family, kind, proto, _, sa in _socket.getaddrinfo(host(addr), port, 0, _socket.SOCK_STREAM):
        s = _socket.socket(family, kind, proto)
        try:
            s.settimeout(timeout)
            s.connect(sa)
            return
        except OSError as exc:
            err = exc
        finally:
            s.close()
    raise err


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
