"""`lmqtt passwd`: manage a password file, with mosquitto_passwd's options.

    lmqtt passwd [-c] FILE USER            add or change USER (prompts twice; -c creates/overwrites FILE)
    lmqtt passwd -b [-c] FILE USER PASS    the same, password on the command line (scripts)
    echo PASS | lmqtt passwd [-c] FILE USER
                                           stdin not a terminal: the password is its first line
                                           (a second line, if any, must repeat it); no prompt
    lmqtt passwd -D FILE USER              delete USER
    lmqtt passwd -U FILE                   hash every plaintext password in FILE in place
    --scram (with any of the above)        also write a SCRAM-SHA-256 verifier (MQTT 5 enhanced auth)

Hashes are `$7$` PBKDF2-SHA512 (gateway/security/auth.py), readable by Mosquitto 2 too. With `--scram` the
line gets a third field, `user:$7$...:$scram-sha-256$ITER$SALT$STOREDKEY$SERVERKEY`, which
Mosquitto ignores; a user who has one keeps it in step when the password changes (a stale
verifier would still accept the old password). The file is replaced atomically with mode 0600.
"""
from __future__ import annotations

import argparse
import getpass
import os
import sys

from lmqtt.gateway.security.auth import (AuthError, hash_password, password_file_entries, read_password_file,
                                split_entry, write_password_file)
from lmqtt.gateway.security.scram import DEFAULT_ITERATIONS, scram_credentials


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmqtt passwd", description=__doc__.split("\n\n")[0])
    p.add_argument("-c", action="store_true", help="create a new file (overwrites an existing one)")
    p.add_argument("-b", action="store_true", help="batch mode: the password is the last argument")
    p.add_argument("-D", action="store_true", help="delete the user")
    p.add_argument("-U", action="store_true", help="hash the plaintext passwords of an existing file")
    p.add_argument("--scram", action="store_true",
                   help="also store a SCRAM-SHA-256 verifier, for MQTT 5 enhanced authentication")
    p.add_argument("--scram-iterations", type=int, default=DEFAULT_ITERATIONS,
                   help=f"PBKDF2 rounds of the SCRAM verifier (default {DEFAULT_ITERATIONS}, RFC 7677's "
                        "minimum; every client login computes them once)")
    p.add_argument("file", help="the password file (its folder must exist)")
    p.add_argument("user", nargs="?", help="the user to add, change or delete")
    p.add_argument("password", nargs="?", help="with -b: the password. Without -b it is asked twice on a "
                   "terminal; when stdin is not a terminal (echo PASS | lmqtt passwd FILE USER) it is stdin's "
                   "first line, no prompt (a second line, if any, must repeat it)")
    return p


def _entry(password: str, scram: bool, iterations: int) -> str:
    h = hash_password(password)
    return f"{h}:{scram_credentials(password, iterations)}" if scram else h


def _write(path: str, users: dict[str, str]) -> int:
    """Replace the file (write_password_file: a temporary file beside it, then a rename); every way
    that fails is one line naming the cause, and no temporary file is left. A missing folder is not
    created (as mosquitto_passwd): a typo in the path would otherwise make a folder nobody reads."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        write_password_file(path, users)
        return 0
    except FileNotFoundError:
        why = (f"the folder {folder} does not exist (create it first: mkdir -p {folder})"
               if not os.path.isdir(folder) else "No such file or directory")
    except NotADirectoryError:
        why = f"a part of {folder} is a file, not a folder"
    except IsADirectoryError:
        why = "it is a directory"
    except PermissionError:
        why = f"permission denied (writing in {folder})"
    except OSError as e:
        why = e.strerror or str(e)
    try:
        os.unlink(f"{path}.tmp-{os.getpid()}")
    except OSError:
        pass
    print(f"lmqtt passwd: cannot write {path}: {why}", file=sys.stderr)
    return 1


def _read(path: str, entries: bool = False):
    """The users of an existing file, or None after printing why it cannot be read."""
    try:
        if entries:
            return list(password_file_entries(path))
        return read_password_file(path)
    except AuthError as e:
        print(f"lmqtt passwd: {e}", file=sys.stderr)
    except UnicodeDecodeError:
        print(f"lmqtt passwd: {path} is not a password file (not UTF-8 text)", file=sys.stderr)
    return None


def _upgrade(path: str, scram: bool, iterations: int) -> int:
    entries = _read(path, entries=True)
    if entries is None:
        return 1
    users = {user: stored if stored.startswith("$") else _entry(stored, scram, iterations)
             for _n, user, stored in entries}
    return _write(path, users)


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.scram_iterations < 4096:
        print("lmqtt passwd: --scram-iterations must be at least 4096 (RFC 7677)", file=sys.stderr)
        return 2
    if a.U:
        return _upgrade(a.file, a.scram, a.scram_iterations)
    if not a.user:
        print("lmqtt passwd: a USER is needed (see --help)", file=sys.stderr)
        return 2
    if ":" in a.user:
        print("lmqtt passwd: a username cannot contain ':'", file=sys.stderr)
        return 2
    users: dict[str, str] = {}
    if not a.c:
        if not os.path.exists(a.file):
            print(f"lmqtt passwd: {a.file} does not exist (use -c to create it)", file=sys.stderr)
            return 1
        users = _read(a.file)
        if users is None:
            return 1
    if a.D:
        if users.pop(a.user, None) is None:
            print(f"lmqtt passwd: user {a.user!r} is not in {a.file}", file=sys.stderr)
            return 1
        return _write(a.file, users)
    if a.b:
        if a.password is None:
            print("lmqtt passwd: -b needs the password as the last argument", file=sys.stderr)
            return 2
        password = a.password
    else:
        folder = os.path.dirname(os.path.abspath(a.file))
        if not os.path.isdir(folder):        # say it before asking for a password it cannot store
            print(f"lmqtt passwd: cannot write {a.file}: the folder {folder} does not exist (create it "
                  f"first: mkdir -p {folder})", file=sys.stderr)
            return 1
        try:
            if sys.stdin is None or not sys.stdin.isatty():
                # a pipe (echo PASS | lmqtt passwd ...): read it, without getpass's "can not
                # control echo" warning and prompts meant for a terminal
                lines = (sys.stdin.read() if sys.stdin is not None else "").splitlines()
                if not lines:
                    raise EOFError
                password = lines[0]
                again = lines[1] if len(lines) > 1 and lines[1] else password
            else:
                password = getpass.getpass("Password: ")
                again = getpass.getpass("Reenter password: ")
        except (EOFError, KeyboardInterrupt):
            print("\nlmqtt passwd: no password given; nothing changed", file=sys.stderr)
            return 1
        if again != password:
            print("lmqtt passwd: passwords do not match", file=sys.stderr)
            return 1
    if not password:
        print("lmqtt passwd: an empty password is not allowed", file=sys.stderr)
        return 2
    had_scram = a.user in users and split_entry(users[a.user])[1] is not None
    users[a.user] = _entry(password, a.scram or had_scram, a.scram_iterations)
    return _write(a.file, users)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
