"""Where the job's torch is, found from its files as the job's python would find it, without
importing torch (seconds) and without running site (the probe starts with python -S).

Standard library only, Python 3.8+: loaded by the bootloader before the probe.
"""
import os
import sys


def torch_facts():
    """Where torch is and its version, from its files (importing torch takes seconds)."""
    spec = find_torch()
    if not spec or not spec.origin:
        return None
    base = os.path.dirname(spec.origin)
    run_py = os.path.join(base, "distributed", "run.py")
    info = {"run_py": run_py if os.path.exists(run_py) else None, "version": None, "cuda": None}
    try:
        with open(os.path.join(base, "version.py")) as f:
            text = f.read()
        info["version"], info["cuda"] = assigned(text, "__version__"), assigned(text, "cuda")
    except OSError:
        pass
    return info


def assigned(text, name):
    """The string a line of version.py gives name (`name = '...'`, `name: T = '...'`), else
    None. Read without re: its patterns, compiled in every node's process, cost ~0.4 ms."""
    for line in text.splitlines():
        head, eq, value = line.partition("=")
        value = value.strip()
        if eq and head.split(":")[0].rstrip() == name and value[:1] == "'" and "'" in value[1:]:
            return value[1:].partition("'")[0]
    return None


def path_finder():
    """importlib.machinery.PathFinder, from sys.meta_path where the interpreter put it:
    importing importlib.machinery (importlib, warnings) costs every node ~0.5 ms."""
    for finder in sys.meta_path:
        if getattr(finder, "__name__", None) == "PathFinder":
            return finder
    from importlib.machinery import PathFinder
    return PathFinder


def find_torch():
    """torch's spec as the job's python, which starts with site, finds it. The probe starts
    without site (python -S: its .pth files' import lines cost a node 4-35 ms), so it looks on
    the folders site would add, in site's order, after what sys.path holds already (PYTHONPATH
    first, as for the job); if torch is not there, site runs after all, import lines and all
    (an editable install's finder may be what finds it), and the import system is asked."""
    if sys.flags.no_site:
        spec = path_finder().find_spec("torch", sys.path + site_paths())
        if spec is not None:
            return spec
        run_site()
    import importlib.util
    return importlib.util.find_spec("torch")


def run_site():
    """site, once, in this process (started with python -S): for a lookup that needs its
    import lines, and before importing torch here (doctor's deep facts)."""
    if sys.flags.no_site and not SITE_RAN:
        import site
        site.main()
        SITE_RAN.append(True)


SITE_RAN: "list[bool]" = []


def site_paths():
    """The folders site would add to sys.path, without running it: a virtual environment's
    site-packages (its pyvenv.cfg, as site reads it), the user's (where site allows it), the
    installation's; each followed by the path lines of its .pth files, in name order."""
    import site
    exe_dir = os.path.dirname(os.path.abspath(sys.executable))
    prefixes, venv = [sys.prefix, sys.exec_prefix], []
    for conf in (os.path.join(exe_dir, "pyvenv.cfg"), os.path.join(os.path.dirname(exe_dir), "pyvenv.cfg")):
        if os.path.isfile(conf):
            if venv_setting(conf, "include-system-site-packages", "true") != "true":
                prefixes = []                # nor the user's site
            venv = [os.path.dirname(exe_dir)]
            sys.prefix = sys.exec_prefix = venv[0]     # as site's venv() sets them (the
            #   site-packages folders it names depend on them; Debian's do)
            break
    dirs = site.getsitepackages(venv) if venv else []       # the venv's first, then the user's
    if prefixes and site.check_enableusersite():
        dirs.append(site.getusersitepackages())
    dirs += site.getsitepackages(list(dict.fromkeys(prefixes)))
    out = []
    for d in dict.fromkeys(dirs):
        if os.path.isdir(d):
            out += [d] + pth_paths(d)
    return out


def venv_setting(conf, key, default):
    try:
        with open(conf, encoding="utf-8") as f:
            for line in f:
                name, eq, value = line.partition("=")
                if eq and name.strip().lower() == key:
                    return value.strip().lower()
    except (OSError, UnicodeDecodeError):
        pass
    return default


def pth_paths(sitedir):
    """The folders a site folder's .pth files add (their import lines are not run)."""
    try:
        names = sorted(n for n in os.listdir(sitedir) if n.endswith(".pth") and not n.startswith("."))
    except OSError:
        return []
    out = []
    for name in names:
        try:
            with open(os.path.join(sitedir, name), encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for line in lines:
            line = line.rstrip()
            if not line or line.startswith("#") or line.startswith(("import ", "import\t")):
                continue
            path = os.path.abspath(os.path.join(sitedir, line))
            if os.path.exists(path):
                out.append(path)
    return out
