"""Placeholder: DTensor sharding rules (filled in by the DTensor rules issue)."""


def install() -> None:
    pass


def uninstall() -> None:
    pass


def installed() -> list:
    return []
