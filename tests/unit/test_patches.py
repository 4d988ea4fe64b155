"""The patch list on its own, no model: patches replace only their own attributes, and restoring removes
what they added."""

from __future__ import annotations

from otel_generate._patch import Patches


def test_patches_replace_only_own_attributes_and_restore_removes_what_they_added():
    class Base:
        def method(self, x):
            return x + 1

    class Child(Base):
        pass

    seen = []

    def factory(original, scale):
        def method(self, x):
            seen.append(x)
            return original(self, x) * scale

        return method

    patches = Patches()
    assert not patches.replace(Child, "method", factory, 10)  # inherited: not Child's own, left alone
    assert patches.replace(Base, "method", factory, 10)
    assert not patches.replace(Base, "method", factory, 10)  # already replaced by this set
    assert patches.add(Child, "extra", 1) and not patches.add(Child, "extra", 2)
    assert Child().method(1) == 20 and seen == [1]
    assert patches.installed() == ((Base, "method"), (Child, "extra"))
    patches.restore_all()
    assert Child().method(1) == 2 and "extra" not in vars(Child) and patches.installed() == ()
