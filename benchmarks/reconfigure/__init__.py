"""One reconfiguration of the cross-group process group, by implementation (docs/compatibility.md)."""
