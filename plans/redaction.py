"""Credentials out of everything the tool prints: one place that knows what a secret looks like.

Three kinds of secret are hidden (decision 101):
- the userinfo of any URL (`scheme://key:secret@host`, a secret holding '/', '+' or '=' too) and
  the same with its scheme cut off, as botocore prints a bucket name (`key:se/cret@bucket`);
- the value of any credential-shaped parameter, in a query string, a header or a connection
  string (`X-Amz-Signature=`, `X-Amz-Credential=`, `sig=`, `sv=`/`se=` of a SAS token,
  `AccountKey=`, `token=`, `password=`, ...);
- every value a credential variable of the environment holds (AWS_SECRET_ACCESS_KEY, ...), and
  every secret the command line itself carried, wherever it shows up: whole, percent-encoded,
  or cut at a '/' (s3fs splits `s3://key:se/cret@bucket` at its first '/').

Pure: the caller passes the environment and the command line (`Redactor.for_process`).
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from urllib.parse import quote, quote_plus, unquote

MASK = "***"
# Environment variables whose whole value is a credential.
SECRET_VARIABLES = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
    "AZURE_STORAGE_KEY", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN", "AZURE_CLIENT_SECRET",
    "GOOGLE_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "RAY_AUTH_TOKEN",
)
# Environment variables that hold credentials among other settings (`AccountKey=...;` parts).
SECRET_BEARING_VARIABLES = ("AZURE_STORAGE_CONNECTION_STRING",)
# Parameter names whose value is a credential (matched case-insensitively).
CREDENTIAL_PARAMETERS = (
    "x-amz-signature", "x-amz-credential", "x-amz-security-token", "signature", "credential", "sig", "sv", "se",
    "skoid", "sktid", "skv", "sas", "sas_token", "accountkey", "sharedaccesssignature", "sharedaccesskey",
    "access_key", "access_key_id", "accesskey", "aws_access_key_id", "aws_secret_access_key", "secret",
    "secret_key", "secretkey", "client_secret", "token", "access_token", "session_token", "password", "passwd",
    "pwd", "key", "api_key", "apikey",
)
SHORTEST_SECRET = 6  # shorter values (a region, "1", "true") would hide ordinary words

_STOP = r"\s\"'<>"
# scheme://userinfo@ where userinfo is user:secret (the secret may hold '/') or a bare user.
URL_USERINFO = re.compile(rf"([A-Za-z][A-Za-z0-9+.-]*://)([^{_STOP}/@:]*:[^{_STOP}@]*|[^{_STOP}/@:]+)@")
# key:secret@ with its scheme cut off (botocore's "Invalid bucket name "KEY:se/cret@bucket"").
BARE_USERINFO = re.compile(rf"(?<![\w/])([A-Za-z0-9+/=_.-]+):(?!//)([^@{_STOP}]{{6,}})@")  # a secret is not short
PARAMETER = re.compile(r"(?<![\w-])(" + "|".join(re.escape(name) for name in CREDENTIAL_PARAMETERS)
                       + rf")=[^&;,{_STOP}#]+", re.IGNORECASE)


_LEADING_BARE_USERINFO = re.compile(r"^[^/@:\s]+:(?!//)[^@\s]+@")


def carries_credentials(url: str) -> bool:
    """Whether a URL holds credentials: userinfo before its host (`s3://key:secret@bucket`, or
    `key:secret@bucket` without the scheme) or a credential parameter in its query string."""
    query = url.partition("?")[2]
    return bool(URL_USERINFO.match(url) or _LEADING_BARE_USERINFO.match(url) or (query and PARAMETER.search(query)))


class Redactor:
    """`redact(text)`: the text with every secret it knows of, and every secret-shaped part,
    replaced by `***`."""

    def __init__(self, secrets: Iterable[str] = ()):
        variants = set()
        for secret in secrets:
            if secret and len(secret) >= SHORTEST_SECRET:
                variants.update({secret, quote(secret, safe=""), quote_plus(secret), unquote(secret)})
        ordered = sorted((v for v in variants if len(v) >= SHORTEST_SECRET), key=len, reverse=True)
        self._known = re.compile("|".join(map(re.escape, ordered))) if ordered else None

    @classmethod
    def for_process(cls, environ: Mapping[str, str], argv: Iterable[str] = ()) -> "Redactor":
        return cls([*environment_secrets(environ), *secrets_in(argv)])

    def redact(self, text: str) -> str:
        if not text:
            return text
        if self._known is not None:
            text = self._known.sub(MASK, text)
        text = URL_USERINFO.sub(rf"\1{MASK}@", text)
        text = BARE_USERINFO.sub(f"{MASK}@", text)
        return PARAMETER.sub(rf"\1={MASK}", text)


def environment_secrets(environ: Mapping[str, str]) -> list[str]:
    """The credential values an environment holds."""
    found = [environ[name] for name in SECRET_VARIABLES if environ.get(name)]
    for name in SECRET_BEARING_VARIABLES:
        found += secrets_in([environ.get(name) or ""])
    return found


def secrets_in(texts: Iterable[str]) -> list[str]:
    """The secrets written into some texts (command-line arguments): URL userinfo (the secret,
    the user, and the secret's pieces between '/', which s3fs prints as a bucket name) and the
    values of credential-shaped parameters."""
    found = []
    for text in texts:
        for match in [*URL_USERINFO.finditer(text), *BARE_USERINFO.finditer(text)]:
            userinfo = match.group(2) if match.re is URL_USERINFO else f"{match.group(1)}:{match.group(2)}"
            user, _, secret = userinfo.partition(":")
            found += [user, secret, *secret.split("/")]
        found += [match.group(0).split("=", 1)[1] for match in PARAMETER.finditer(text)]
    return [secret for secret in found if len(secret) >= SHORTEST_SECRET]
