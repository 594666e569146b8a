"""InternVL dynamic tiling: grids checked by hand against InternVL's rule."""

import pytest

from encoders.tiling.grid import (
    internvl_candidate_grids,
    internvl_grid,
    internvl_num_tiles,
    internvl_tile_boxes,
)

# (width, height, image_size, expected (cols, rows), expected tiles incl. thumbnail)
HAND_CHECKED = [
    (448, 448, 448, (1, 1), 1),  # (2,2) ties on ratio but area 200704 <= 0.5*448²*4
    (100, 100, 448, (1, 1), 1),  # tiny thumbnail: one upscaled tile
    (1000, 500, 448, (2, 1), 3),  # exact 2:1; (4,2) ties but area is under half of 8 tiles
    (900, 448, 448, (2, 1), 3),  # nearest ratio 2 (diff 0.009)
    (1500, 500, 448, (3, 1), 4),  # (6,2) ties; 750000 <= 0.5*448²*12
    (800, 800, 448, (2, 2), 5),  # tie (1,1)/(2,2): 640000 > 401408; (3,3) needs > 903168
    (1344, 896, 448, (3, 2), 7),  # exact 3:2
    (2000, 1000, 448, (4, 2), 9),  # tie with (2,1), area 2e6 > 802816 -> the larger grid
    (1024, 1024, 448, (3, 3), 10),  # ties up to (3,3): 1048576 > 903168
    (1200, 448, 448, (5, 2), 11),  # ratio 2.68: 5/2 (diff 0.18) beats 3/1 (diff 0.32)
    (640, 480, 448, (4, 3), 13),  # exact 4:3 beats every area tie-break
    (800, 600, 448, (4, 3), 13),
    (4000, 300, 448, (12, 1), 13),  # extreme panorama: widest grid
    (300, 4000, 448, (1, 12), 13),  # tall screenshot
    (48, 48, 48, (1, 1), 1),  # the embedded model's canonical tile
    (96, 48, 48, (2, 1), 3),
    (96, 96, 48, (2, 2), 5),  # 9216 > 0.5*48²*4
    (144, 96, 48, (3, 2), 7),
    (480, 48, 48, (10, 1), 11),
    (48, 576, 48, (1, 12), 13),
]


@pytest.mark.parametrize("width,height,image_size,grid,num_tiles", HAND_CHECKED)
def test_internvl_grid_matches_hand_checked(width, height, image_size, grid, num_tiles):
    assert internvl_grid(width, height, image_size=image_size, max_num=12) == grid
    assert internvl_num_tiles(width, height, image_size=image_size, max_num=12) == num_tiles


def test_every_tile_count_from_1_to_13_except_2_is_reachable():
    # With a thumbnail a multi-tile grid gives >= 3 tiles, so 2 never occurs.
    counts = {row[4] for row in HAND_CHECKED}
    sizes = [(w, h) for w in range(48, 700, 24) for h in range(48, 700, 24)]
    counts |= {internvl_num_tiles(w, h, image_size=48) for w, h in sizes}
    assert counts == set(range(1, 14)) - {2}


def test_candidates_are_ordered_by_tile_count_within_bounds():
    grids = internvl_candidate_grids(1, 12)
    products = [c * r for c, r in grids]
    assert products == sorted(products)
    assert min(products) == 1 and max(products) == 12
    assert len(grids) == len(set(grids))
    assert all(2 <= c * r <= 6 for c, r in internvl_candidate_grids(2, 6))


def test_min_num_forces_tiling_and_no_thumbnail_option():
    assert internvl_grid(448, 448, image_size=448, min_num=2, max_num=12) == (2, 2)
    assert internvl_num_tiles(1000, 500, image_size=448, use_thumbnail=False) == 2


def test_tile_boxes_are_row_major():
    boxes = internvl_tile_boxes((3, 2), image_size=10)
    assert boxes == [
        (0, 0, 10, 10),
        (10, 0, 20, 10),
        (20, 0, 30, 10),
        (0, 10, 10, 20),
        (10, 10, 20, 20),
        (20, 10, 30, 20),
    ]


@pytest.mark.parametrize("bad", [(0, 10), (10, 0), (-1, 5)])
def test_rejects_empty_images(bad):
    with pytest.raises(ValueError):
        internvl_grid(*bad, image_size=448)


def test_rejects_bad_tile_range():
    with pytest.raises(ValueError):
        internvl_grid(10, 10, image_size=448, min_num=3, max_num=2)
