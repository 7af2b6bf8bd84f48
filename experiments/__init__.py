"""The measurements behind autockpt's claims, run as ``python -m experiments.<folder>.<script>`` (README.md)."""
