/**
 * monarch-kernel in JupyterLab: a Mesh sidebar, a status-bar item for the active
 * notebook's mesh, and a "run on mesh" cell toolbar button (%%on_mesh).
 */
import { ILabShell, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { IStatusBar } from '@jupyterlab/statusbar';
import { Widget } from '@lumino/widgets';

import { api, counts, countsText, leaseText, MeshModel } from './model';
import { MeshPanel } from './panel';

/** The notebook panel in front, duck-typed (the notebook package is not a dependency). */
function activeNotebook(app: JupyterFrontEnd, last: { panel: any }): any {
  const w: any = app.shell.currentWidget;
  if (w && w.content && w.sessionContext && 'activeCell' in w.content) {
    last.panel = w;
  }
  return last.panel && !last.panel.isDisposed ? last.panel : null;
}

async function insertCell(app: JupyterFrontEnd, nb: any, source: string, run: boolean): Promise<void> {
  if (!nb) {
    window.alert('Open a notebook first.');
    return;
  }
  app.shell.activateById(nb.id);
  await app.commands.execute('notebook:insert-cell-above');
  const cell = nb.content.activeCell;
  cell.model.sharedModel.setSource(source);
  if (run) {
    await app.commands.execute('notebook:run-cell');
  }
}

function logsWidget(app: JupyterFrontEnd, mesh: string): void {
  const w = new Widget();
  w.id = `monarch-logs-${mesh}-${Date.now()}`;
  w.title.label = `logs: ${mesh}`;
  w.title.closable = true;
  w.addClass('mk-logs');
  const pre = document.createElement('pre');
  pre.textContent = 'loading...';
  w.node.appendChild(pre);
  app.shell.add(w, 'main');
  api(`${encodeURIComponent(mesh)}/logs?tail=500`)
    .then(d => {
      pre.textContent = d.lines.length
        ? d.lines.map((l: any) => `[rank ${l.rank}${l.stream === 'stderr' ? ' stderr' : ''}] ${l.text}`).join('\n')
        : 'no output kept for this mesh yet';
    })
    .catch(e => (pre.textContent = String(e)));
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'monarch-kernel:plugin',
  description: 'Mesh sidebar, status bar and run-on-mesh button for monarch-kernel',
  autoStart: true,
  requires: [ILabShell],
  optional: [IStatusBar],
  activate: (app: JupyterFrontEnd, labShell: ILabShell, statusBar: IStatusBar | null) => {
    const model = new MeshModel();
    const last: { panel: any } = { panel: null };
    const notebook = () => activeNotebook(app, last);
    const kernel = () => notebook()?.sessionContext?.session?.kernel ?? null;

    const panel = new MeshPanel(model, {
      insertConnect: mesh => void insertCell(app, notebook(), `%mesh connect ${mesh}`, false),
      stop: mesh => {
        if (window.confirm(`Stop mesh ${mesh}? Its procs and their state end.`)) {
          void api(`${encodeURIComponent(mesh)}/stop`, { method: 'POST' }).then(() => model.refresh());
        }
      },
      respawn: () => {
        kernel()?.requestExecute({ code: 'mesh.respawn();', silent: true, store_history: false });
      },
      logs: mesh => logsWidget(app, mesh),
      debug: () => void insertCell(app, notebook(), '%mesh debug', true)
    });
    labShell.add(panel, 'left', { rank: 600 });

    app.commands.addCommand('monarch:run-on-mesh', {
      label: 'on mesh',
      caption: 'Run this cell on every rank of the mesh (%%on_mesh)',
      execute: async () => {
        const nb = notebook();
        const cell = nb?.content?.activeCell;
        if (!cell || cell.model.type !== 'code') {
          return;
        }
        const src: string = cell.model.sharedModel.getSource();
        if (!src.startsWith('%%on_mesh')) {
          cell.model.sharedModel.setSource(`%%on_mesh\n${src}`);
        }
        await app.commands.execute('notebook:run-cell');
      }
    });
    app.commands.addCommand('monarch:show-meshes', {
      label: 'Show the Mesh panel',
      execute: () => labShell.activateById(panel.id)
    });

    const follow = () => {
      const k = kernel();
      model.kernelId = k ? k.id : null;
      model.watch('status', !!notebook());
    };
    labShell.currentChanged.connect(follow);
    follow();
    window.setInterval(follow, 2000); // a kernel started or restarted under the same notebook

    if (statusBar) {
      const item = new Widget();
      item.addClass('mk-status-item');
      const render = () => {
        const m = model.kernelMesh();
        item.node.classList.remove('mk-red', 'mk-amber');
        if (!m) {
          item.node.textContent = '';
          return;
        }
        const c = counts(m);
        item.node.textContent =
          `mesh ${m.name} · ${c.procs} procs` + countsText(c) + ` · ${leaseText(m)}`;
        item.node.classList.toggle('mk-red', c.dead + c.hostsGone > 0);
        item.node.classList.toggle('mk-amber', c.dead + c.hostsGone === 0 && c.paused + c.stuck > 0);
        item.node.title = 'click: show the Mesh panel';
      };
      item.node.addEventListener('click', () => labShell.activateById(panel.id));
      model.onChange(render);
      statusBar.registerStatusItem('monarch-kernel:status', {
        item,
        align: 'left',
        rank: 5
      });
    }
    (window as any).monarchMeshModel = model; // for tests and the curious
  }
};

export default plugin;
