#!/usr/bin/python
# Installs a set of small files (certificates, keys) in one module call: each file's
# content, mode and group are compared with what is on the host, and only the files that
# differ are written. A loop of ansible.builtin.copy costs two module runs per file even
# when nothing changed, and a node holds a dozen TLS files.

from __future__ import annotations

import base64
import grp
import os
import stat
import tempfile

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: metronome_files
short_description: Install small files whose content comes from the controller, in one call
description:
  - Writes each file whose content differs and sets its mode and group; reports the files
    it changed (or would change, in check mode). A new content is written to a temporary
    file with its final mode and group and renamed into place, so a key is never readable
    by more than it should be, not even for a moment.
options:
  dir:
    description: The folder the files go in (it must exist).
    type: path
    required: true
  files:
    description: The files, each with C(path) (below I(dir)), C(content) (base64), C(mode)
      (octal string) and optional C(group).
    type: list
    elements: dict
    required: true
"""

RETURN = r"""
changed_files:
  description: The path (below I(dir)) of every file written or whose mode or group was set.
  type: list
  elements: str
  returned: always
"""


def install(module: AnsibleModule, spec: dict) -> bool:
    dest, mode = os.path.join(module.params["dir"], spec["path"]), int(spec["mode"], 8)
    content = base64.b64decode(spec["content"])
    gid = None
    if spec.get("group"):
        try:
            gid = grp.getgrnam(spec["group"]).gr_gid
        except KeyError:
            module.fail_json(msg=f"{dest}: group {spec['group']} does not exist")
    try:
        st = os.stat(dest)
        with open(dest, "rb") as f:
            current = f.read()
    except FileNotFoundError:
        st, current = None, None
    same_content = current == content
    if same_content and stat.S_IMODE(st.st_mode) == mode and gid in (None, st.st_gid):
        return False
    if module.check_mode:
        return True
    if same_content:
        if gid is not None:
            os.chown(dest, -1, gid)
        os.chmod(dest, mode)
        return True
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(dest), prefix=".metronome-")
    try:
        with os.fdopen(fd, "wb") as f:
            if gid is not None:
                os.fchown(f.fileno(), -1, gid)
            os.fchmod(f.fileno(), mode)
            f.write(content)
        os.replace(tmp, dest)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return True


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "dir": {"type": "path", "required": True},
            "files": {
                "type": "list",
                "elements": "dict",
                "required": True,
                # Only the contents are secret: a no_log path would be masked in
                # changed_files too, and the restarts are decided from it.
                "options": {
                    "path": {"type": "str", "required": True},
                    "content": {"type": "str", "required": True, "no_log": True},
                    "mode": {"type": "str", "required": True},
                    "group": {"type": "str", "default": ""},
                },
            },
        },
        supports_check_mode=True,
    )
    changed = [spec["path"] for spec in module.params["files"] if install(module, spec)]
    module.exit_json(changed=bool(changed), changed_files=changed)


if __name__ == "__main__":
    main()
