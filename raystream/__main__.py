"""``python -m raystream ...`` is the ``raystream`` command (what ``raystream submit`` runs on the
cluster, where the ``raystream`` script may not be on PATH but the Python that runs Ray is)."""

from raystream.cli import main

if __name__ == "__main__":
    main(prog_name="raystream")
