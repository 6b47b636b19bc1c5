"""CURVE keys for the bus over TCP: the broker is the CURVE server, every actor a client.

Theory of operation:
    The broker holds a server keypair; clients know its public key and hold their own
    keypair. A ZAP authenticator on the broker's context admits a client only if its
    public key is on the allow list, so a peer with no keys (or unknown keys) never
    completes the handshake: it can neither publish into the broker nor receive.

Keys are Z85 text (40 bytes), the format of `zmq.curve_keypair` and of the key files
`zmq.auth.create_certificates` writes, which `CurveKeys.load` reads.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterable

import msgspec
import zmq
import zmq.auth
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator

Z85_KEY_LEN = 40


def _check_key(key: bytes, what: str) -> bytes:
    if isinstance(key, str):
        key = key.encode("ascii")
    if not isinstance(key, bytes) or len(key) != Z85_KEY_LEN:
        raise ValueError(f"{what} must be a {Z85_KEY_LEN}-character Z85 CURVE key")
    try:
        zmq.utils.z85.decode(key)
    except Exception as e:  # z85 raises ValueError/KeyError on bad characters
        raise ValueError(f"{what} is not valid Z85: {e}") from None
    return key


class CurveKeys(msgspec.Struct, frozen=True):
    """A CURVE keypair (secret may be empty for a public-only certificate)."""

    public_key: bytes
    secret_key: bytes = b""

    def __post_init__(self) -> None:
        _check_key(self.public_key, "public_key")
        if self.secret_key:
            _check_key(self.secret_key, "secret_key")

    @classmethod
    def generate(cls) -> CurveKeys:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    def save(self, directory: str | pathlib.Path, name: str) -> pathlib.Path:
        """Write `<name>.key` (public) and `<name>.key_secret`; returns the secret file."""
        if not self.secret_key:
            raise ValueError("cannot save a keypair without its secret key")
        d = pathlib.Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        for suffix, secret in ((".key", None), (".key_secret", self.secret_key)):
            lines = ["metadata", "curve", f'    public-key = "{self.public_key.decode()}"']
            if secret is not None:
                lines.append(f'    secret-key = "{secret.decode()}"')
            path = d / f"{name}{suffix}"
            path.write_text("\n".join(lines) + "\n")
            if secret is not None:
                path.chmod(0o600)
        return d / f"{name}.key_secret"

    @classmethod
    def load(cls, path: str | pathlib.Path) -> CurveKeys:
        public, secret = zmq.auth.load_certificate(str(path))
        return cls(public, secret or b"")


def load_public_keys(directory: str | pathlib.Path) -> tuple[bytes, ...]:
    """Every public key in a directory of `*.key` certificate files."""
    d = pathlib.Path(directory)
    if not d.is_dir():
        raise ValueError(f"no such key directory: {d}")
    return tuple(sorted(zmq.auth.load_certificate(str(p))[0] for p in d.glob("*.key")))


class CurveServer(msgspec.Struct, frozen=True):
    """The broker's side: its keypair and the client public keys it admits."""

    keys: CurveKeys
    allowed_clients: tuple[bytes, ...]

    def __post_init__(self) -> None:
        if not self.keys.secret_key:
            raise ValueError("the CURVE server needs its secret key")
        for k in self.allowed_clients:
            _check_key(k, "allowed client key")


class CurveClient(msgspec.Struct, frozen=True):
    """An actor's side: its keypair and the broker's public key."""

    keys: CurveKeys
    server_public_key: bytes

    def __post_init__(self) -> None:
        if not self.keys.secret_key:
            raise ValueError("a CURVE client needs its secret key")
        _check_key(self.server_public_key, "server_public_key")


class _AllowList:
    def __init__(self, keys: Iterable[bytes]) -> None:
        self.keys = frozenset(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


def start_authenticator(context: zmq.Context, server: CurveServer) -> ThreadAuthenticator:
    """A ZAP handler on `context` admitting only `server.allowed_clients`."""
    auth = ThreadAuthenticator(context)
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=_AllowList(server.allowed_clients))
    return auth


def apply_server(sock: zmq.Socket, server: CurveServer) -> None:
    sock.curve_secretkey = server.keys.secret_key
    sock.curve_publickey = server.keys.public_key
    sock.curve_server = True


def apply_client(sock: zmq.Socket, client: CurveClient) -> None:
    sock.curve_secretkey = client.keys.secret_key
    sock.curve_publickey = client.keys.public_key
    sock.curve_serverkey = client.server_public_key


def check_endpoint(endpoint: str, *, curve: bool, allow_insecure_tcp: bool) -> str:
    """Refuse unknown schemes, and tcp:// without CURVE unless explicitly allowed."""
    if not isinstance(endpoint, str) or "://" not in endpoint:
        raise ValueError(f"bad bus endpoint {endpoint!r}: expected ipc:// or tcp://")
    scheme = endpoint.split("://", 1)[0]
    if scheme == "inproc":  # the broker owns its context, so inproc:// could never connect
        raise ValueError(
            f"bad bus endpoint {endpoint!r}: within one process use InProcHub, not inproc://"
        )
    if scheme not in ("ipc", "tcp"):
        raise ValueError(f"bad bus endpoint {endpoint!r}: scheme must be ipc or tcp")
    if scheme == "tcp" and not curve and not allow_insecure_tcp:
        raise ValueError(
            f"refusing unauthenticated TCP bus endpoint {endpoint!r}: give CURVE keys, "
            "or pass allow_insecure_tcp=True on a trusted network"
        )
    return endpoint
