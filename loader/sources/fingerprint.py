"""Source fingerprints: what a checkpoint source held when a repository was built from it.

A model key names a source by its URI (or a pinned revision); the content behind a URI can
change (a local file overwritten, ``hf://org/name@main`` moving, a gs:// prefix re-uploaded).
The fingerprint records the content, cheaply, so a later run can tell whether the source still
holds what the published repository was built from:

==========  ===================================================================================
scheme      fingerprint
==========  ===================================================================================
``hf``      the commit the revision resolved to (one API call; none for a URI naming a commit)
``gs``      every object under the prefix: name, size, generation and CRC32C (MD5 when the
            object has none), from one listing
``file``    every file: relative path, size and digest (BLAKE3, :mod:`loader.digest`; sha256
            in the fingerprints of earlier loaders, and to compare with one of those). The
            digest of a file is computed once; a later run reuses the recorded one while the
            file's (mtime, ctime, inode, size) are unchanged (ctime cannot be set by users; a
            write through the file system moves it, one through a shared writable mapping into
            a page already dirty does not: ``run --verify full`` hashes every file again) and
            hashes the file again otherwise, so a touched but identical file is not a change
==========  ===================================================================================

:meth:`Fingerprint.changes` lists the differences in words; the stat stamps of local files are
a cache, never compared between runs. Within a run they are (:meth:`Fingerprint.written`): a
file written to between the run's first look and its last may have been read while it held
other bytes, even if it holds the first ones again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loader.errors import shown

#: Differences listed in an error message at most.
_LIST_AT_MOST = 5


@dataclass(frozen=True)
class Fingerprint:
    """What a source held: its canonical URI, the commit (hf) and its files."""

    uri: str
    commit: str | None = None
    #: relative path -> identity fields (compared) of each file or object
    files: dict[str, dict[str, object]] = field(default_factory=dict)
    #: relative path -> [mtime_ns, ctime_ns, inode] of local files (a cache, not compared)
    stamps: dict[str, list[int]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        record: dict[str, object] = {"uri": self.uri}
        if self.commit is not None:
            record["commit"] = self.commit
        if self.files:
            record["files"] = {rel: dict(info) for rel, info in sorted(self.files.items())}
        if self.stamps:
            record["stamps"] = {rel: list(s) for rel, s in sorted(self.stamps.items())}
        return record

    @classmethod
    def from_dict(cls, record: object) -> Fingerprint | None:
        """The fingerprint a manifest recorded; ``None`` when there is none or it is malformed."""
        if not isinstance(record, dict) or not isinstance(record.get("uri"), str):
            return None
        files = record.get("files") or {}
        stamps = record.get("stamps") or {}
        commit = record.get("commit")
        if not isinstance(files, dict) or not isinstance(stamps, dict):
            return None
        if commit is not None and not isinstance(commit, str):
            return None
        return cls(
            uri=record["uri"],
            commit=commit,
            files={str(k): dict(v) for k, v in files.items() if isinstance(v, dict)},
            stamps={str(k): list(v) for k, v in stamps.items() if isinstance(v, list)},
        )

    def changes(self, current: Fingerprint) -> list[str]:
        """What differs from ``current`` (empty: the same content), in words."""
        found = []
        if self.uri != current.uri:
            found.append(f"the source was {self.uri}, now {current.uri}")
        if self.commit != current.commit:
            found.append(f"commit {self.commit or '-'} is now {current.commit or '-'}")
        removed = sorted(set(self.files) - set(current.files))
        added = sorted(set(current.files) - set(self.files))
        changed = sorted(
            rel
            for rel in set(self.files) & set(current.files)
            if self.files[rel] != current.files[rel]
        )
        found += [f"{shown(rel)} changed" for rel in changed]
        found += [f"{shown(rel)} was removed" for rel in removed]
        found += [f"{shown(rel)} was added" for rel in added]
        return found

    def written(self, current: Fingerprint) -> list[str]:
        """The local files of both whose stat stamps moved from these to ``current``'s (ctime
        or inode: written to, or replaced), in words: compared within one run, where what a
        file holds at its end says nothing of what it held while it was read (changed and
        changed back)."""
        return [
            f"{shown(rel)} was written to"
            for rel in sorted(set(self.stamps) & set(current.stamps))
            if rel in self.files
            and rel in current.files
            and self.files[rel] == current.files[rel]
            and self.stamps[rel] != current.stamps[rel]
        ]


def describe_changes(changes: list[str]) -> str:
    shown = "; ".join(changes[:_LIST_AT_MOST])
    more = len(changes) - _LIST_AT_MOST
    return shown + (f"; and {more} more" if more > 0 else "")
