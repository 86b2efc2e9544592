"""ensure_dir under concurrency: threads creating the same new directory at once all succeed."""

import threading

from service.store.fsutil import ensure_dir


def test_threads_creating_the_same_new_directory_all_succeed(tmp_path):
    errors: list[Exception] = []
    for round_ in range(60):
        target = tmp_path / f"r{round_}" / "fp" / "ns"
        barrier = threading.Barrier(8)

        def make():
            barrier.wait()
            try:
                ensure_dir(target)
            except Exception as e:  # it raised NotADirectoryError for a directory another thread just made
                errors.append(e)

        threads = [threading.Thread(target=make) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert target.is_dir()
    assert not errors, errors[:3]
