"""WebShop's data files: where they are, checking them, and reading the products into a catalog.

WebShop (Yao et al., NeurIPS 2022) ships its catalog as JSON files that its setup script
downloads (`setup.sh -d small` or `-d all` in the princeton-nlp/WebShop repository):

- `items_shuffle_1000.json` / `items_shuffle.json`: the products (a list of dicts: name, pricing,
  customization_options, full_description, small_description, category, query,
  product_category, asin, ...), 1,000 products or the full 1.18M;
- `items_ins_v2_1000.json` / `items_ins_v2.json`: per ASIN, the product's `attributes` and, for
  some products, an `instruction` with its `instruction_attributes` (what goals are made from);
- `items_human_ins.json`: 12,251 instructions written by people, per ASIN.

A data root (an explicit path, else `$WEBSHOP_DATA`, else `~/.cache/webshop/data`) holds them
under those names. Files whose sha256 is published (`SHA256`) are checked before use, once per
process; a missing or different file is an error that says where to get it. A catalog can also
be read from another product file in the same schema (`products_file`, e.g. the test fixture);
such a file is not checked, since no hash is known for it.

A `Catalog` is immutable and cached per process (`get_catalog`), so that every sandbox forked
from a process that loaded it shares its memory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from envs import base
from envs.webshop.search import SearchIndex

__all__ = [
    "CACHE_ENV_VAR",
    "CATALOGS",
    "DATA_ENV_VAR",
    "DEFAULT_CACHE_DIR",
    "DEFAULT_DATA_ROOT",
    "HUMAN_GOALS_FILE",
    "SHA256",
    "Catalog",
    "CatalogSpec",
    "DataIntegrityError",
    "Product",
    "get_catalog",
    "parse_products",
    "resolve_catalog",
    "resolve_data_root",
    "sha256_of",
    "verified_file",
]

log = logging.getLogger(__name__)

DATA_ENV_VAR = "WEBSHOP_DATA"
CACHE_ENV_VAR = "WEBSHOP_CACHE"
DEFAULT_DATA_ROOT = "~/.cache/webshop/data"
DEFAULT_CACHE_DIR = "~/.cache/bpo_jax/webshop"

# Published hashes (../shared/data/webshop/README.md). The full-catalog files have none.
SHA256: dict[str, str | None] = {
    "items_shuffle_1000.json": "30a4765c3a327af72d9a9a95a6b2486d516f0fa1d3ecd83681901ce82a21b269",
    "items_ins_v2_1000.json": "f88a36314a397b53b3d9c3fa5878e5f7b26d35019a51ec83fbedeca61a948f6f",
    "items_human_ins.json": "cf78667548a71786e1d9049c24b802e48e1084ad4bb021cae56ce1f6d96954a3",
    "items_shuffle.json": None,
    "items_ins_v2.json": None,
}

# Catalog name -> (product file, attribute file).
CATALOGS: dict[str, tuple[str, str]] = {
    "small": ("items_shuffle_1000.json", "items_ins_v2_1000.json"),
    "full": ("items_shuffle.json", "items_ins_v2.json"),
}
HUMAN_GOALS_FILE = "items_human_ins.json"

_GET_DATA_HINT = (
    "Get WebShop's data files with its own setup script on a machine with internet access "
    "(`./setup.sh -d small` in the princeton-nlp/WebShop repository writes them to its data/ "
    f"folder; `-d all` adds the full catalog), then point ${DATA_ENV_VAR} (or the data-root "
    "argument, config env.data_root) at the folder that holds them."
)

# Without any price, WebShop shows (and scores) a product at $100.
_DEFAULT_PRICE = 100.0
_PRICE_RE = re.compile(r"[\d,]*\.?\d+")


class DataIntegrityError(ValueError):
    """A data file is not the published one (its sha256 differs)."""


@dataclasses.dataclass(frozen=True)
class Product:
    """One product as the environment shows and scores it.

    Attributes:
        asin: Amazon id as in the data (upper case); shown and clicked in lower case.
        name: Title.
        category: WebShop's top-level category (beauty, electronics, fashion, food, furniture).
        query: The search query the product was collected with (lower case).
        product_category: Amazon's breadcrumb, levels separated by "›".
        price: The one price the product is shown and scored at: the listed price, or for a
            range a draw inside it that is fixed per ASIN (WebShop draws it per run).
        price_tag: The listed price text, e.g. "$10.99 - $12.99".
        description: Long description.
        features: Bullet points.
        options: (option group, its values), groups and values lower case, in data order.
        rating: Average rating text ("N.A." when absent).
        attributes: The attribute file's attributes of the product (empty when absent).
        instruction: The attribute file's instruction for the product, or None.
        instruction_attributes: The attributes that instruction asks for.
    """

    asin: str
    name: str
    category: str
    query: str
    product_category: str
    price: float
    price_tag: str
    description: str
    features: tuple[str, ...]
    options: tuple[tuple[str, tuple[str, ...]], ...]
    rating: str
    attributes: tuple[str, ...]
    instruction: str | None
    instruction_attributes: tuple[str, ...]

    def option_values(self, group: str) -> tuple[str, ...]:
        """The values of one option group (empty if the product has no such group)."""
        return dict(self.options).get(group, ())

    def search_text(self) -> str:
        """The text the search index holds for the product: title, description, features and
        options, lower case (the fields WebShop's own index is built from)."""
        option_text = ", and ".join(f"{g}: {', '.join(vs)}" for g, vs in self.options)
        parts = [self.name, self.description, " ".join(self.features), option_text]
        return " ".join(p for p in parts if p).lower()


@dataclasses.dataclass(frozen=True)
class CatalogSpec:
    """Which files make a catalog; hashable, so it names the catalog in caches and tasks.

    Attributes:
        name: "small", "full" or "custom" (a products file outside the published ones).
        products_path: Absolute path of the product file.
        products_sha256: Its sha256 (keys the search-index cache).
        attributes_path: Absolute path of the attribute file.
        cache_dir: Writable folder for the search index.
    """

    name: str
    products_path: str
    products_sha256: str
    attributes_path: str
    cache_dir: str


def resolve_data_root(root: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Finds the WebShop data root: `root`, else `$WEBSHOP_DATA`, else `~/.cache/webshop/data`.

    Raises:
        FileNotFoundError: If the chosen folder does not exist.
    """
    return base.resolve_data_root(
        root,
        env_var=DATA_ENV_VAR,
        default=DEFAULT_DATA_ROOT,
        label="WebShop data root",
        hint=_GET_DATA_HINT,
    )


def sha256_of(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file's bytes, as hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# (path, size, mtime_ns) -> sha256, so that a file is hashed once per process.
_HASHED: dict[tuple[str, int, int], str] = {}


def _hash_cached(path: pathlib.Path) -> str:
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _HASHED:
        _HASHED[key] = sha256_of(path)
    return _HASHED[key]


def verified_file(root: pathlib.Path, name: str) -> tuple[pathlib.Path, str]:
    """Returns (path, sha256) of the published file `name` in `root`, checked against `SHA256`.

    Raises:
        FileNotFoundError: If the file is missing (the message says where to get it).
        DataIntegrityError: If its sha256 differs from the published one.
    """
    path = root / name
    if not path.is_file():
        raise FileNotFoundError(
            f"WebShop data file {name!r} is missing from the data root {str(root)!r}. "
            f"{_GET_DATA_HINT}"
        )
    digest = _hash_cached(path)
    expected = SHA256.get(name)
    if expected is None:
        log.warning("WebShop file %s has no published sha256; it is used unchecked.", path)
    elif digest != expected:
        raise DataIntegrityError(
            f"WebShop data file {str(path)!r} has sha256 {digest}, but the published file has "
            f"{expected}: it is truncated, modified or another version. Replace it with the "
            f"original. {_GET_DATA_HINT}"
        )
    return path, digest


def resolve_catalog(
    data_root: str | os.PathLike[str] | None = None,
    catalog: str = "small",
    products_file: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> CatalogSpec:
    """Finds and checks the files of a catalog.

    Args:
        data_root: See `resolve_data_root`.
        catalog: "small" (1,000 products) or "full".
        products_file: A product file in the items_shuffle schema to use instead of the
            catalog's (not checked: no hash is published for it); the attribute file still
            comes from the data root.
        cache_dir: Writable folder for the search index (default `$WEBSHOP_CACHE`, else
            `~/.cache/bpo_jax/webshop`). The data root may be read-only.

    Raises:
        ValueError: For an unknown catalog name.
        FileNotFoundError, DataIntegrityError: See `verified_file`.
    """
    if catalog not in CATALOGS:
        raise ValueError(f"Unknown WebShop catalog {catalog!r}; expected one of {list(CATALOGS)}.")
    root = resolve_data_root(data_root)
    products_name, attributes_name = CATALOGS[catalog]
    attributes_path, _ = verified_file(root, attributes_name)
    if products_file:
        path = pathlib.Path(products_file).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"WebShop products file {str(path)!r} does not exist.")
        name, products_path, products_sha = "custom", path, _hash_cached(path)
    else:
        products_path, products_sha = verified_file(root, products_name)
        name = catalog
    if cache_dir:
        cache = pathlib.Path(cache_dir)
    else:
        cache = pathlib.Path(os.environ.get(CACHE_ENV_VAR) or DEFAULT_CACHE_DIR)
    return CatalogSpec(
        name=name,
        products_path=str(products_path),
        products_sha256=products_sha,
        attributes_path=str(attributes_path),
        cache_dir=str(cache.expanduser().resolve()),
    )


def _parse_prices(pricing: Any) -> list[float]:
    """Numbers after each "$" of a pricing text ("$10.99", "$10.99 - $12.99")."""
    if isinstance(pricing, (int, float)) and not isinstance(pricing, bool):
        return [float(pricing)]
    if not isinstance(pricing, str) or "$" not in pricing:
        return []
    prices = []
    for part in pricing.split("$")[1:]:
        m = _PRICE_RE.search(part)
        if m:
            prices.append(float(m.group(0).replace(",", "")))
    return prices[:2]


def _clean_value(text: Any) -> str:
    # Brackets would end a click[...] action early; whitespace runs are not typeable reliably.
    text = str(text).replace("[", "(").replace("]", ")")
    return " ".join(text.split()).lower()


def parse_products(
    raw_products: Sequence[Mapping[str, Any]], attributes: Mapping[str, Mapping[str, Any]]
) -> tuple[Product, ...]:
    """Turns items_shuffle records and the attribute file into `Product`s.

    Like WebShop's loader, records without a usable ASIN are dropped and a repeated ASIN keeps
    its first record; option groups and values are lower-cased.
    """
    products: list[Product] = []
    seen: set[str] = set()
    for raw in raw_products:
        asin = str(raw.get("asin") or "").strip()
        if not asin or asin == "nan" or len(asin) > 10 or asin in seen:
            continue
        seen.add(asin)
        prices = _parse_prices(raw.get("pricing"))
        if not prices:
            price, tag = _DEFAULT_PRICE, f"${_DEFAULT_PRICE:.2f}"
        elif len(prices) == 1:
            price, tag = prices[0], f"${prices[0]:.2f}"
        else:
            lo, hi = sorted(prices)
            # One draw per ASIN, the same in every process and run.
            price = round(random.Random(f"webshop-price:{asin}").uniform(lo, hi), 2)
            tag = f"${lo:.2f} - ${hi:.2f}"
        options = []
        for group, contents in (raw.get("customization_options") or {}).items():
            if not contents:
                continue
            values: list[str] = []
            for content in contents:
                value = _clean_value(content.get("value", "") if isinstance(content, dict) else "")
                if value and value not in values:
                    values.append(value)
            if values:
                options.append((_clean_value(group), tuple(values)))
        features = raw.get("small_description") or []
        if isinstance(features, str):
            features = [features]
        info = attributes.get(asin) or {}
        rating = raw.get("average_rating")
        products.append(
            Product(
                asin=asin,
                name=" ".join(str(raw.get("name") or "").split()),
                category=str(raw.get("category") or "").strip().lower(),
                query=str(raw.get("query") or "").strip().lower(),
                product_category=str(raw.get("product_category") or ""),
                price=float(price),
                price_tag=tag,
                description=" ".join(str(raw.get("full_description") or "").split()),
                features=tuple(" ".join(str(f).split()) for f in features if f),
                options=tuple(options),
                rating=str(rating) if rating else "N.A.",
                attributes=tuple(info.get("attributes") or ()),
                instruction=info.get("instruction") or None,
                instruction_attributes=tuple(info.get("instruction_attributes") or ()),
            )
        )
    return tuple(products)


class Catalog:
    """The products of a catalog and their search index (read-only after construction).

    Attributes:
        spec: The files it was read from.
        products: Products in file order (the search index's document order).
    """

    def __init__(self, spec: CatalogSpec, products: Sequence[Product]):
        if not products:
            raise ValueError(f"WebShop catalog {spec.products_path!r} has no usable product.")
        self.spec = spec
        self.products = tuple(products)
        self._by_asin = {p.asin: p for p in self.products}
        self.index = SearchIndex.build_or_load(
            [p.search_text() for p in self.products],
            key=spec.products_sha256,
            cache_dir=pathlib.Path(spec.cache_dir),
        )
        # The first search sets up lazily built state; doing it here, before a sandbox server
        # forks its workers, saves each fresh sandbox a few milliseconds on its first search.
        self.index.search(self.products[0].name, 1)

    def __len__(self) -> int:
        return len(self.products)

    def get(self, asin: str) -> Product | None:
        """The product with this ASIN (any case), or None."""
        return self._by_asin.get(asin.upper()) or self._by_asin.get(asin)

    def search(self, query: str, k: int) -> list[Product]:
        """The `k` best products for `query` by BM25, best first (ties in catalog order)."""
        return [self.products[i] for i in self.index.search(query, k)]

    def rank_of(self, query: str, asin: str, k: int) -> int | None:
        """Position (0-based) of `asin` in the top `k` results for `query`, or None."""
        for i, p in enumerate(self.search(query, k)):
            if p.asin == asin:
                return i
        return None


_CATALOGS: dict[CatalogSpec, Catalog] = {}


def get_catalog(spec: CatalogSpec) -> Catalog:
    """The catalog of `spec`, read (and its index built or loaded) on first use in a process."""
    catalog = _CATALOGS.get(spec)
    if catalog is None:
        with open(spec.products_path) as f:
            raw_products = json.load(f)
        with open(spec.attributes_path) as f:
            attributes = json.load(f)
        if not isinstance(raw_products, list):
            raise ValueError(
                f"WebShop products file {spec.products_path!r} should hold a JSON list of "
                f"products (the items_shuffle schema), not a {type(raw_products).__name__}."
            )
        catalog = Catalog(spec, parse_products(raw_products, attributes))
        _CATALOGS[spec] = catalog
    return catalog
