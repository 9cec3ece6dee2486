"""`lmqtt passwd`: manage a password file, with mosquitto_passwd's options.

    lmqtt passwd [-c] FILE USER            add or change USER (prompts twice; -c creates/overwrites FILE)
    lmqtt passwd -b [-c] FILE USER PASS    the same, password on the command line (scripts)
    lmqtt passwd -D FILE USER              delete USER
    lmqtt passwd -U FILE                   hash every plaintext password in FILE in place

Hashes are `$7$` PBKDF2-SHA512 (gateway/auth.py), readable by Mosquitto 2 too. The file is replaced
atomically with mode 0600.
"""
from __future__ import annotations

import argparse
import getpass
import os
import sys

from lmqtt.gateway.auth import (AuthError, hash_password, password_file_entries, read_password_file,
                                write_password_file)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmqtt passwd", description=__doc__.split("\n\n")[0])
    p.add_argument("-c", action="store_true", help="create a new file (overwrites an existing one)")
    p.add_argument("-b", action="store_true", help="batch mode: the password is the last argument")
    p.add_argument("-D", action="store_true", help="delete the user")
    p.add_argument("-U", action="store_true", help="hash the plaintext passwords of an existing file")
    p.add_argument("file")
    p.add_argument("user", nargs="?")
    p.add_argument("password", nargs="?")
    return p


def _upgrade(path: str) -> int:
    try:
        users = {user: stored if stored.startswith("$") else hash_password(stored)
                 for _n, user, stored in password_file_entries(path)}
    except AuthError as e:
        print(f"lmqtt passwd: {e}", file=sys.stderr)
        return 1
    write_password_file(path, users)
    return 0


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.U:
        return _upgrade(a.file)
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
        try:
            users = read_password_file(a.file)
        except AuthError as e:
            print(f"lmqtt passwd: {e}", file=sys.stderr)
            return 1
    if a.D:
        if users.pop(a.user, None) is None:
            print(f"lmqtt passwd: user {a.user!r} is not in {a.file}", file=sys.stderr)
            return 1
        write_password_file(a.file, users)
        return 0
    if a.b:
        if a.password is None:
            print("lmqtt passwd: -b needs the password as the last argument", file=sys.stderr)
            return 2
        password = a.password
    else:
        password = getpass.getpass("Password: ")
        if getpass.getpass("Reenter password: ") != password:
            print("lmqtt passwd: passwords do not match", file=sys.stderr)
            return 1
    if not password:
        print("lmqtt passwd: an empty password is not allowed", file=sys.stderr)
        return 2
    users[a.user] = hash_password(password)
    write_password_file(a.file, users)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
