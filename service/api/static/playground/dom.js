// Small DOM helpers shared by the page's parts. Text from the service is only ever set as textContent.

export function cell(text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

export function button(text, title, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = text;
  b.title = title;
  b.addEventListener("click", onClick);
  return b;
}

// A list of plain text items into a <ul>; `empty` when there are none.
export function fillList(ul, items, empty) {
  const lis = (items.length ? items : [empty]).map((text) => {
    const li = document.createElement("li");
    li.textContent = text;
    if (!items.length) li.className = "muted";
    return li;
  });
  ul.replaceChildren(...lis);
}

// Shows an ApiError (or any error) as "<type> (HTTP <status>): <message>"; null hides the box.
export function showError(box, err) {
  if (!err) {
    box.hidden = true;
    box.replaceChildren();
    delete box.dataset.type;
    return;
  }
  const type = document.createElement("strong");
  type.className = "error-type";
  type.textContent = err.type || err.name || "error";
  const status = err.status ? ` (HTTP ${err.status})` : "";
  box.replaceChildren(type, document.createTextNode(`${status}: ${err.message}`));
  box.dataset.type = type.textContent;
  box.hidden = false;
}

export function ms(value) {
  return value === null || value === undefined ? "-" : `${Math.round(value).toLocaleString("en")} ms`;
}

export function count(value) {
  return value === null || value === undefined ? "-" : Number(value).toLocaleString("en");
}
