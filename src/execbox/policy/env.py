"""The env policy: the sandbox inherits nothing from the host, and the caller's secrets stay with the caller.

A request variable is dropped (and its name, never its value, reported in ``filtered_env``) when its NAME
or its VALUE looks like a secret.

Names. A name that is not plain ASCII of the shape ``[A-Za-z_][A-Za-z0-9_.-]*`` is dropped outright: no
tool reads a variable named with Cyrillic, Greek or fullwidth letters, so such a name is a mistake or a
disguise (``ΟPENAI_API_KEY`` with a Greek capital omicron), and dropping all of them is complete where a
confusables table would always miss a letter (NFKC alone does not map Cyrillic to Latin). An ASCII name
is matched case-insensitively, split into words at ``_ . -``, camelCase and digits:

- anywhere (substrings): SECRET, PASSWORD, PASSWD, PASSPHRASE, PASSCODE, PGPASS, SSHPASS, PRIVATE_KEY,
  PRIVKEY, API_KEY, ACCESS_KEY, MNEMONIC, SEED (PYTHONHASHSEED alone excepted), CREDENTIAL, BEARER, JWT,
  DATABASE_URL, CONNECTION_STRING, CONN_STR, TOKEN (not TOKENIZERS_...), AUTH (not AUTHOR: GIT_AUTHOR_NAME
  passes; AUTHORIZATION does not);
- a whole word anywhere: PASS, PWD (but the shell's own PWD passes), URI, DSN, SALT, OTP, TOTP, HOTP,
  HMAC, WEBHOOK, COOKIE(S); URL next to a database or broker word (REDIS_URL, MONGO_URL, AMQP_URL, ...);
  BW_SESSION / OP_SESSION_* (password-manager sessions);
- the last word (trailing digits ignored): KEY or KEYS, PK, SK, PAT, PW. A key is also still a key with
  an encoding or container word after it (SIGNING_KEY_B64, SSH_KEY_PATH, GPG_KEY_ID). Data-modelling keys
  pass (SORT_KEY, PRIMARY_KEY_COLUMN, PARTITION_KEY, SSH_PUBLIC_KEY), and so do words that merely contain KEY (MONKEY,
  KEYBOARD_LAYOUT). A false positive costs the caller a rename; a miss costs a secret, so ties drop.

Values. A value is dropped when it holds a URL with a password (``scheme://user:pass@host``), a
``password=``/``AccountKey=`` pair of a connection string, a PEM private key (also base64-wrapped), a
JWT, an ``Authorization`` header value, or a random-looking token with a known vendor prefix (GitHub,
GitLab, OpenAI, Anthropic, Slack, AWS access key ids, Google, Hugging Face, npm, PyPI, SendGrid, Shopify,
Stripe, ...). Every value pattern is linear in the value's length: nothing nests a repetition.

Separately, ``is_injection_name`` names the loader and interpreter start-up variables (LD_PRELOAD,
PYTHONPATH, BASH_ENV, ...). They may reach the sandboxed command, which could set them itself anyway, but
never a host-side process that starts it (see ``execbox.kit.processes``).
"""

from __future__ import annotations

import base64
import math
import re
from collections import Counter

# The whole environment a sandboxed command starts with, before the caller's filtered variables.
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

_SHAPE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*\Z")
_WORDS = re.compile(r"[A-Z0-9]+(?![a-z])|[A-Z]?[a-z0-9]+")
_SUBSTRINGS = re.compile(
    r"SECRET|PASSWORD|PASSWD|PASSPHRASE|PASSCODE|PGPASS|SSHPASS|PRIVATE[_.-]?KEY|PRIVKEY|API[_.-]?KEY|ACCESS[_.-]?KEY"
    r"|MNEMONIC|SEED|CREDENTIAL|BEARER|JWT|DATABASE[_.-]?URL|CONNECTION[_.-]?STRING|CONN[_.-]?STR|TOKEN(?!I[SZ])"
    r"|AUTH(?!OR(?!I[SZ]))"
)
_ANY_WORD = frozenset({"PASS", "PWD", "URI", "URIS", "DSN", "SALT", "OTP", "TOTP", "HOTP", "HMAC", "WEBHOOK", "COOKIE",
                       "COOKIES"})
_LAST_WORD = frozenset({"KEY", "KEYS", "PK", "SK", "PAT", "PW"})
_KEY_MATERIAL = frozenset({"ID", "B64", "BASE64", "PEM", "HEX", "JSON", "DATA", "VALUE", "FILE", "PATH", "RAW",
                           "BYTES", "STR", "STRING", "TEXT", "CONTENT", "CONTENTS"})
# keys that are data, not credentials
_BENIGN_KEYS = frozenset({"SORT", "PRIMARY", "FOREIGN", "PARTITION", "SHARD", "ROUTING", "IDEMPOTENCY", "CACHE",
                          "PUBLIC"})
_STORES = frozenset({"DATABASE", "DB", "REDIS", "MONGO", "MONGODB", "POSTGRES", "POSTGRESQL", "PG", "PGSQL", "MYSQL",
                     "MARIADB", "AMQP", "RABBITMQ", "BROKER", "CELERY", "SQLALCHEMY", "MEMCACHED", "KAFKA", "NATS",
                     "ELASTICSEARCH", "OPENSEARCH", "CLICKHOUSE", "NEO4J", "COUCHDB", "SUPABASE", "DIRECT", "SHADOW",
                     "CONNECTION", "CONN"})


def is_secret_name(name: str) -> bool:
    """Whether the policy drops a variable by its name alone (see the module docstring for the rules)."""
    if not name.isascii() or not _SHAPE.match(name):
        return True
    upper = name.upper()
    if upper in ("PYTHONHASHSEED", "PWD"):
        return False
    if _SUBSTRINGS.search(upper):
        return True
    words = [w.upper() for w in _WORDS.findall(name)]
    bare = [w.rstrip("0123456789") for w in words]  # PASS2 is PASS, KEY_2 is KEY
    if _ANY_WORD.intersection(bare) or bare[:2] in (["BW", "SESSION"], ["OP", "SESSION"]):
        return True
    if {"URL", "URLS"}.intersection(bare) and _STORES.intersection(words):
        return True
    while len(bare) > 1 and (not bare[-1] or words[-1] in _KEY_MATERIAL):
        words.pop()
        bare.pop()
    if not bare or bare[-1] not in _LAST_WORD:
        return False
    return not (bare[-1] in {"KEY", "KEYS"} and len(bare) > 1 and bare[-2] in _BENIGN_KEYS)


def _random_looking(body: str) -> bool:
    """Letters and digits mixed, at least 3 bits of entropy a character: a generated token, not a word."""
    if not (any(c.isdigit() for c in body) and any(c.isalpha() for c in body)):
        return False
    counts = Counter(body)
    entropy = -sum(n / len(body) * math.log2(n / len(body)) for n in counts.values())
    return entropy >= 3.0


_EDGE = r"(?<![A-Za-z0-9])"
# (prefix, body): a known vendor prefix followed by a random-looking body.
_TOKEN_PATTERNS = [re.compile(_EDGE + prefix + "(" + body + ")") for prefix, body in [
    (r"gh[pousr]_", r"[A-Za-z0-9]{30,}"),                       # GitHub classic, OAuth, app tokens
    (r"github_pat_", r"[A-Za-z0-9_]{40,}"),                     # GitHub fine-grained
    (r"gl(?:pat|dt|rt|ptt|cbt|imt|soat|ffct|agent|oas)-", r"[A-Za-z0-9_-]{20,}"),  # GitLab
    (r"sk-(?:ant-|proj-|svcacct-|admin-)?", r"[A-Za-z0-9_-]{20,}"),  # OpenAI, Anthropic
    (r"(?:sk|rk)_(?:live|test)_", r"[A-Za-z0-9]{16,}"),         # Stripe secret / restricted
    (r"whsec_", r"[A-Za-z0-9+/=]{20,}"),                        # Stripe webhook secret
    (r"xox[abposer]-", r"[A-Za-z0-9-]{20,}"),                   # Slack
    (r"xapp-", r"[A-Za-z0-9-]{20,}"),
    (r"(?:AKIA|ASIA|ABIA|ACCA)", r"[A-Z2-7]{16}(?![A-Za-z0-9])"),  # AWS access key ids
    (r"AIza", r"[0-9A-Za-z_-]{35}"),                            # Google API key
    (r"ya29\.", r"[0-9A-Za-z_-]{30,}"),                         # Google OAuth access token
    (r"GOCSPX-", r"[0-9A-Za-z_-]{20,}"),                        # Google OAuth client secret
    (r"hf_", r"[A-Za-z0-9]{30,}"),                              # Hugging Face
    (r"npm_", r"[A-Za-z0-9]{36,}"),                             # npm
    (r"pypi-", r"[A-Za-z0-9_-]{50,}"),                          # PyPI
    (r"SG\.", r"[A-Za-z0-9_-]{16,}\.[A-Za-z0-9_-]{16,}"),       # SendGrid
    (r"shp(?:at|ca|pa|ss)_", r"[a-fA-F0-9]{32}"),               # Shopify
    (r"do[opr]_v1_", r"[a-f0-9]{64}"),                          # DigitalOcean
    (r"dckr_pat_", r"[A-Za-z0-9_-]{20,}"),                      # Docker Hub
    (r"dapi", r"[a-f0-9]{32}"),                                 # Databricks
    (r"gl(?:c|sa)_", r"[A-Za-z0-9_=+/-]{32,}"),                 # Grafana
    (r"hv[sb]\.", r"[A-Za-z0-9_-]{24,}"),                       # HashiCorp Vault
    (r"PMAK-", r"[a-f0-9-]{40,}"),                              # Postman
    (r"gsk_", r"[A-Za-z0-9]{40,}"),                             # Groq
    (r"r8_", r"[A-Za-z0-9]{30,}"),                              # Replicate
    (r"(?:pplx|xai)-", r"[A-Za-z0-9]{30,}"),                    # Perplexity, xAI
    (r"lin_api_", r"[A-Za-z0-9]{30,}"),                         # Linear
    (r"sntr[ysu]_", r"[A-Za-z0-9+/=_-]{30,}"),                  # Sentry auth tokens
    (r"sbp_", r"[a-f0-9]{40}"),                                 # Supabase
    (r"AGE-SECRET-KEY-1", r"[0-9A-Z]{50,}"),                    # age
    (r"[xyzt]prv", r"[1-9A-HJ-NP-Za-km-z]{100,}"),              # BIP-32 extended private key
    (r"(?i:bearer|basic|token)\s", r"[A-Za-z0-9._~+/=-]{16,}"),  # an Authorization header value
]]
_STRUCTURED = re.compile(
    r"://[^\s/@:]*:[^\s/@]+@"                                   # URL userinfo with a password
    r"|-----BEGIN [A-Z0-9 ]{0,40}PRIVATE KEY"                   # PEM private key
    r"|eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\."            # JWT: base64url JSON header and payload
    r"|(?i:(?:^|[;&?\s])(?:password|passwd|pwd|accountkey|sharedaccesskey|sig)[ \t]*=[ \t]*[^;&\s])"
)
_B64_PEM = "LS0tLS1CRUdJTi"  # base64 of "-----BEGIN"


def is_secret_value(value: str) -> bool:
    """Whether a value carries a credential, whatever its variable is called."""
    if _STRUCTURED.search(value):
        return True
    at = value.find(_B64_PEM)
    if at >= 0:
        chunk = re.sub(r"[^A-Za-z0-9+/]", "", value[at:at + 120])
        head = base64.b64decode(chunk[:len(chunk) // 4 * 4]).decode("latin-1")
        if _STRUCTURED.search(head):
            return True
    return any(_random_looking(m.group(1)) for pattern in _TOKEN_PATTERNS for m in pattern.finditer(value))


def filter_env(env: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """Split the caller's variables into the ones passed on and the (sorted) names dropped."""
    kept = {k: v for k, v in env.items() if not (is_secret_name(k) or is_secret_value(v))}
    return kept, sorted(env.keys() - kept.keys())


def sandbox_env(request_env: dict[str, str], *, home: str, path: str = BASE_PATH) -> dict[str, str]:
    """The full environment for a sandboxed command: a minimal base plus the (already filtered) request env."""
    env = {"PATH": path, "HOME": home, "LANG": "C.UTF-8", "TMPDIR": "/tmp", "PYTHONUNBUFFERED": "1"}
    env.update(request_env)
    return env


# Read by the dynamic loader, libc or an interpreter at start-up: in a host-side process (a launcher, a
# helper) they would run the sandboxed code's choice of library or script with the caller's privileges.
_INJECTION_NAMES = frozenset({
    "GETCONF_DIR", "HOSTALIASES", "LOCALDOMAIN", "LOCPATH", "NIS_PATH", "NLSPATH", "RESOLV_HOST_CONF", "RES_OPTIONS",
    "TZDIR", "GLIBC_TUNABLES", "BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "PS4", "IFS", "CDPATH", "JAVA_TOOL_OPTIONS",
    "_JAVA_OPTIONS", "JDK_JAVA_OPTIONS", "PHPRC", "PHP_INI_SCAN_DIR", "TCLLIBPATH", "OPENSSL_CONF", "OPENSSL_ENGINES",
    "OPENSSL_MODULES", "SSLKEYLOGFILE", "GIO_EXTRA_MODULES", "GTK_MODULES", "GTK_PATH", "QT_PLUGIN_PATH",
})
_INJECTION_PREFIXES = ("LD_", "DYLD_", "GCONV_", "MALLOC_", "BASH_FUNC_", "PYTHON", "PERL", "RUBY", "NODE_", "LUA_",
                       "GIT_")


def is_injection_name(name: str) -> bool:
    """Whether a variable can make a process load or run code it did not ask for (the loader, libc, shells,
    interpreters, git): such a variable is never given to a host-side process."""
    upper = name.upper()
    return upper in _INJECTION_NAMES or upper.startswith(_INJECTION_PREFIXES)


def host_env() -> dict[str, str]:
    """The whole environment of a host-side helper or launcher: nothing of the request, nothing of the host."""
    return {"PATH": BASE_PATH, "LANG": "C.UTF-8"}
