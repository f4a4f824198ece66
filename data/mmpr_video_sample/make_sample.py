"""Write the MMPR-format video sample (MMPR-video-sample/): tiny clips of a square moving over a plain background,
drawn here (CC0), as MPEG-4 files (PyAV) and as frame-image lists, plus a few still images for mixed records.

    python data/mmpr_video_sample/make_sample.py     # rewrites MMPR-video-sample/ (deterministic)
"""

from __future__ import annotations

import json
from pathlib import Path

import av
import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent / "MMPR-video-sample"
W, H = 48, 32
MOVES = {"right": (8, 0), "left": (-8, 0), "down": (0, 6), "up": (0, -6)}
COLORS = {"yellow": (230, 200, 30), "red": (220, 40, 40), "green": (40, 190, 60), "white": (240, 240, 240)}


def frame(i: int, move: str, color: str) -> np.ndarray:
    dx, dy = MOVES[move]
    a = np.full((H, W, 3), (20, 24, 60), np.uint8)
    x0, y0 = (4 if dx >= 0 else 28) + dx * i, (4 if dy >= 0 else 16) + dy * i
    a[y0:y0 + 12, x0:x0 + 12] = COLORS[color]
    return a


def write_clip(path: Path, frames: list[np.ndarray], fps: int = 2) -> None:
    with av.open(str(path), "w", format="mp4") as c:
        s = c.add_stream("mpeg4", rate=fps)
        s.width, s.height, s.pix_fmt = W, H, "yuv420p"
        for a in frames:
            c.mux(s.encode(av.VideoFrame.from_ndarray(a, format="rgb24")))
        c.mux(s.encode())


def main() -> None:
    media = HERE / "media"
    for sub in ("clips", "frames", "images"):
        (media / sub).mkdir(parents=True, exist_ok=True)
    (HERE / "annotations").mkdir(exist_ok=True)
    q_move = "Which way does the square move? Answer with one word."
    clips, frame_rows, mixed = [], [], []
    for k, (move, color) in enumerate([("right", "yellow"), ("left", "red"), ("down", "green"), ("up", "white")]):
        wrong = {"right": "Left", "left": "Right", "down": "Up", "up": "Down"}[move]
        frames = [frame(i, move, color) for i in range(4)]
        write_clip(media / "clips" / f"clip_{k}.mp4", frames)
        clips.append({"video": f"clips/clip_{k}.mp4", "question": f"<video>\n{q_move}",
                      "chosen": f"{move.capitalize()}.", "rejected": f"{wrong}."})
        names = []
        for i, a in enumerate(frames[:3]):  # three frames: the last tubelet repeats its frame
            Image.fromarray(a).save(media / "frames" / f"clip_{k}_{i}.png")
            names.append(f"frames/clip_{k}_{i}.png")
        frame_rows.append({"video": names, "question": q_move, "chosen": f"The {color} square moves {move}.",
                           "rejected": f"The {color} square moves {wrong.lower()}."})
        Image.fromarray(frame(0, move, color)).save(media / "images" / f"still_{k}.png")
        mixed.append({"image": f"images/still_{k}.png", "video": f"clips/clip_{k}.mp4",
                      "question": "Is the square in the image the one that moves in the video?",
                      "chosen": f"Yes, the {color} square.", "rejected": "No, the video shows a circle."})
    meta = {}
    for name, rows in (("moving_square_clips", clips), ("moving_square_frames", frame_rows),
                       ("moving_square_image_and_clip", mixed)):
        (HERE / "annotations" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        meta[name] = {"root": "MMPR-video-sample/media", "annotation": f"MMPR-video-sample/annotations/{name}.jsonl",
                      "data_augment": False, "repeat_time": 1, "length": len(rows)}
    (HERE / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


if __name__ == "__main__":
    main()
