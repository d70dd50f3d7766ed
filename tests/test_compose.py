"""The Docker deployment's secure defaults, checked statically (no Docker needed).

docker-compose.yaml is parsed with PyYAML (its ``<<`` merge keys resolve as
compose resolves them); the files it mounts from docker/ are read as they are.
Each test fails on the deployment as it stood before these defaults: ports
published on every interface, Redis and Mosquitto open to anyone, SRL_SECRET
optional, a queue URL on the nodes' command line, the image running as root.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]

REQUIRED_REF = re.compile(r"^\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*):\?[^}]+\}$")
"""``${VAR:?message}``: compose refuses to start while VAR is unset or empty"""
REFERENCE = re.compile(r"(?<!\$)\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)")
"""any ``${VAR...}`` compose interpolates (``$${...}`` is an escaped dollar, not a reference)"""
SECRET_NAME = re.compile(r"PASS|SECRET|TOKEN|AUTH|CREDENTIAL|PRIVATE", re.IGNORECASE)
URL_PASSWORD = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s/@:'\"]*:(?P<password>[^\s/@'\"]+)@")
FORBIDDEN_FLAGS = ("--password", "--secret", "--url", "--queue-url")
"""options whose value is, or may carry, a credential: `ps` shows a command line to every user"""


def compose() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yaml").read_text(encoding="utf-8"))
    return document


def services() -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = compose()["services"]
    return found


def srl_services() -> dict[str, dict[str, Any]]:
    """The services that run srl: built from this repository's Dockerfile."""
    return {name: s for name, s in services().items() if "build" in s or str(s.get("image", "")).startswith("srl")}


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.partition("=")[::2] for item in env)
    return {key: "" if value is None else str(value) for key, value in env.items()}


def argv(service: dict[str, Any], key: str) -> list[str]:
    value = service.get(key) or []
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


def mounted_files(service: dict[str, Any]) -> dict[str, Path]:
    """Container path -> file in this repository, for the service's bind mounts of repository files."""
    mounts: dict[str, Path] = {}
    for volume in service.get("volumes") or []:
        if isinstance(volume, dict):
            source, target = str(volume.get("source", "")), str(volume.get("target", ""))
        else:
            source, _, rest = str(volume).partition(":")
            target = rest.partition(":")[0]
        if source.startswith("."):
            mounts[target] = (ROOT / source).resolve()
    return mounts


def config_lines(path: Path) -> list[list[str]]:
    """A config file as lists of words, comments and blank lines dropped."""
    lines = (line.split("#", 1)[0].split() for line in path.read_text(encoding="utf-8").splitlines())
    return [words for words in lines if words]


def walk_strings(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [s for key, value in node.items() for s in (*walk_strings(key), *walk_strings(value))]
    if isinstance(node, list):
        return [s for item in node for s in walk_strings(item)]
    return [node] if isinstance(node, str) else []


def test_every_published_port_binds_loopback_only() -> None:
    exposed = []
    for name, service in services().items():
        if service.get("network_mode") == "host":
            exposed.append(f"{name}: network_mode host (every port of the container on every interface)")
        for port in service.get("ports") or []:
            if isinstance(port, dict):
                loopback = port.get("host_ip") == "127.0.0.1"
            else:
                parts = str(port).split(":")
                loopback = len(parts) == 3 and parts[0] == "127.0.0.1"
            if not loopback:
                exposed.append(f"{name}: {port!r}")
    assert not exposed, (
        f"ports published beyond this host: {exposed}; expected each as \"127.0.0.1:HOST:CONTAINER\" "
        "(other containers reach a service by its name, the host through loopback)")


def test_secrets_are_required_references_never_literal_values() -> None:
    literal = [
        f"{name}.environment.{key}={value!r}"
        for name, service in services().items()
        for key, value in environment(service).items()
        if SECRET_NAME.search(key) and not REQUIRED_REF.match(value)
    ]
    assert not literal, (
        f"secret-like variables not given as ${{VAR:?message}}: {literal}; a literal lands in git and an "
        "optional ${VAR:-} lets the stack start without it: reference a variable of .env with :?")


def test_no_url_in_the_compose_file_carries_a_password() -> None:
    # comments included: a URL with a password in a comment is copied into .env as it is
    text = (ROOT / "docker-compose.yaml").read_text(encoding="utf-8")
    leaked = [
        match.group(0) for match in URL_PASSWORD.finditer(text)
        if not (match.group("password").startswith("${") or match.group("password").startswith("<"))
    ]
    assert not leaked, f"URLs with a literal password in docker-compose.yaml: {leaked}; write <VARIABLE> or ${{VAR}}"


def test_srl_secret_is_required_for_every_srl_service() -> None:
    nodes = srl_services()
    assert {"trainer", "actor", "client"} <= set(nodes), (
        f"expected the srl services trainer, actor, client; found {sorted(nodes)}")
    unsigned = {}
    for name, service in nodes.items():
        value = environment(service).get("SRL_SECRET")
        match = REQUIRED_REF.match(value or "")
        if not match or match.group("name") != "SRL_SECRET":
            unsigned[name] = value
    assert not unsigned, (
        f"SRL_SECRET not required for {unsigned}; every srl service needs "
        "SRL_SECRET: ${SRL_SECRET:?...} or it sends and accepts unsigned messages")


def test_no_credentials_on_an_srl_command_line() -> None:
    exposed = {}
    for name, service in srl_services().items():
        words = argv(service, "entrypoint") + argv(service, "command")
        bad = [
            word for word in words
            if "://" in word or "$" in word or any(word == f or word.startswith(f + "=") for f in FORBIDDEN_FLAGS)
        ]
        if bad:
            exposed[name] = bad
    assert not exposed, (
        f"srl command lines carrying URLs, interpolated values or credential options: {exposed}; "
        "`ps` shows a command line to every user: set SRL_REDIS_URL, SRL_REDIS_PASSWORD, SRL_QUEUE_URL "
        "and SRL_SECRET in the service's environment instead")


def test_redis_requires_a_password_from_the_environment() -> None:
    redis = services()["redis"]
    startup = argv(redis, "entrypoint") + argv(redis, "command")
    text = " ".join(startup)
    for target, path in mounted_files(redis).items():
        if any(target in word for word in startup):
            text += "\n" + path.read_text(encoding="utf-8")
    assert re.search(r"requirepass\W+\$\{?SRL_REDIS_PASSWORD\b", text), (
        f"redis is started as {startup} with no requirepass from SRL_REDIS_PASSWORD (looked in the command and "
        "in the scripts it runs); without it anyone who reaches port 6379 owns the board")
    password = environment(redis).get("SRL_REDIS_PASSWORD", "")
    assert REQUIRED_REF.match(password), (
        f"redis's SRL_REDIS_PASSWORD is {password!r}, expected ${{SRL_REDIS_PASSWORD:?...}}")


def test_redis_bounds_values_and_keeps_its_tasks_across_a_restart() -> None:
    redis = services()["redis"]
    confs = [path for target, path in mounted_files(redis).items() if target.endswith(".conf")]
    assert confs, f"redis mounts no config file from this repository (volumes: {redis.get('volumes')})"
    settings = {words[0].lower(): words[1:] for words in config_lines(confs[0])}
    from srl.runner.distribution.wire.codec import MAX_CHECKPOINT_MEMORY_BYTES

    bulk = settings.get("proto-max-bulk-len", [""])[0].lower()
    assert bulk.endswith("mb"), f"{confs[0]}: proto-max-bulk-len in mb expected (a bound on one value), got {bulk!r}"
    # bounded, yet above the largest checkpoint on the board (its replay memory, weights and optimizer state)
    assert 2 * MAX_CHECKPOINT_MEMORY_BYTES <= int(bulk[:-2]) << 20 <= 1 << 30, f"{confs[0]}: {bulk}"
    assert settings.get("save") == ['""'], f"{confs[0]}: save \"\" expected (no RDB snapshots)"
    # a restarted Redis without its data loses every task on it (docs/operations.md, Watching and operating)
    assert settings.get("appendonly") == ["yes"], f"{confs[0]}: appendonly yes expected"
    assert settings.get("dir") == ["/data"], f"{confs[0]}: dir /data expected (the AOF in a volume)"
    data = [str(v) for v in redis.get("volumes") or [] if str(v).split(":")[1:2] == ["/data"]]
    assert data and data[0].split(":")[0] in (compose().get("volumes") or {}), (
        f"redis keeps /data in no named volume (volumes: {redis.get('volumes')})")
    assert "requirepass" not in settings, f"{confs[0]} holds a literal requirepass; it comes from SRL_REDIS_PASSWORD"


def test_mosquitto_refuses_anonymous_clients() -> None:
    mounts = mounted_files(services()["mosquitto"])
    conf = mounts.get("/mosquitto/config/mosquitto.conf")
    assert conf is not None, f"mosquitto mounts no /mosquitto/config/mosquitto.conf from this repository ({mounts})"
    settings = {words[0]: words[1:] for words in config_lines(conf)}
    assert settings.get("allow_anonymous") == ["false"], (
        f"{conf}: allow_anonymous {settings.get('allow_anonymous')}; expected false, or anyone who reaches "
        "port 1883 reads and forges experience")
    assert "password_file" in settings, f"{conf}: no password_file, so no client could log in"
    # srl's MQTT queue relies on these (docs/operations.md, Broker notes)
    assert settings.get("max_queued_messages") == ["0"], f"{conf}: max_queued_messages 0 expected"
    assert settings.get("set_tcp_nodelay") == ["true"], f"{conf}: set_tcp_nodelay true expected"
    assert settings.get("max_inflight_messages") == ["128"], f"{conf}: max_inflight_messages 128 expected"


def test_rabbitmq_has_its_own_user_not_guest() -> None:
    env = environment(services()["rabbitmq"])
    assert env.get("RABBITMQ_DEFAULT_USER", "guest") != "guest", (
        "rabbitmq: set RABBITMQ_DEFAULT_USER (guest/guest is public)")
    password = env.get("RABBITMQ_DEFAULT_PASS", "")
    assert REQUIRED_REF.match(password), (
        f"rabbitmq: RABBITMQ_DEFAULT_PASS is {password!r}, expected ${{SRL_RABBITMQ_PASSWORD:?...}}")


def test_env_example_lists_every_variable_and_fails_closed() -> None:
    example = ROOT / ".env.example"
    assert example.exists(), ".env.example is missing: it lists what docker-compose.yaml reads from .env"
    values = {}
    for line in example.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    strings = walk_strings(compose())
    used = {m.group("name") for s in strings for m in REFERENCE.finditer(s)}
    missing = sorted(used - set(values))
    assert not missing, f"variables docker-compose.yaml reads but .env.example lacks: {missing}"
    required = {m.group("name") for s in strings if (m := REQUIRED_REF.match(s))}
    filled = {name: values[name] for name in required if values[name]}
    assert not filled, (
        f".env.example fills required variables {sorted(filled)}; leave them empty so a copied, "
        "unedited .env makes compose refuse to start instead of running with a published password")
    ignored = (ROOT / ".gitignore").read_text(encoding="utf-8").split()
    assert ".env" in ignored or "/.env" in ignored, ".env (the real secrets) must be in .gitignore"


def test_image_runs_srl_as_an_unprivileged_user_with_cpu_torch() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    users = re.findall(r"^USER\s+(\S+)", dockerfile, flags=re.MULTILINE)
    assert users and users[-1].split(":")[0] not in ("root", "0"), (
        f"the image's last USER is {users[-1] if users else 'unset (root)'}; srl nodes must not run as root")
    index = re.search(r"^ARG TORCH_INDEX=(\S+)$", dockerfile, flags=re.MULTILINE)
    assert index and index.group(1) == "https://download.pytorch.org/whl/cpu", (
        "the Dockerfile's torch index must default to the CPU one (a bare torch pulls GB of CUDA packages)")
    install = re.search(r"^RUN pip install[^\n]*--index-url \"\$TORCH_INDEX\"[^\n]*torch==", dockerfile,
                        flags=re.MULTILINE)
    assert install and install.start() < dockerfile.index('".[all]"'), (
        "the Dockerfile must install torch from TORCH_INDEX before the project")
